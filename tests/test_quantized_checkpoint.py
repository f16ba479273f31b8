"""genlab's quantized checkpoint (genlib/models/qformat.py, genlib/models/qwrite.py,
scripts/quantize_model.py): the tool writes quant.quantize's codes and reproducible
bytes; a folder it wrote loads offline, runs its codes as stored on the native kernel
with the greedy tokens of a float forward over the dequantized weights, and reports its
format and size; a broken folder is one line and exit 2; the built-in models report
theirs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from genlib.backends import quant
from genlib.backends.choose import Request, choose_backend
from genlib.backends.llama import LeanLlama
from genlib.backends.native import native_step
from genlib.errors import ModelLoadError
from genlib.models import qformat, qwrite
from genlib.models.loading import BUILTIN_MODELS, ModelSpec, load_model
from tests.conftest import CODE_DRAFT, CODE_TARGET, ROOT
from tests.test_quantized import greedy_lean, greedy_native

FLOAT_DRAFT = Path("code-draft-bf16")  # `written` makes it: code-draft stored in bfloat16
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """`written(source, fmt)`: the folder the tool writes from `source` in `fmt`, once."""
    folders: dict[tuple[Path, str], Path] = {}

    def write(source: Path, fmt: str) -> Path:
        if source == FLOAT_DRAFT:
            source = float_draft(tmp_path_factory)
        if not source.is_dir():
            pytest.skip(f"{source} is not present")
        if (source, fmt) not in folders:
            out = tmp_path_factory.mktemp("quantized") / f"{source.name}-{fmt}"
            qwrite.write(source, out, fmt)
            folders[source, fmt] = out
        return folders[source, fmt]

    return write


def float_draft(tmp_path_factory) -> Path:
    """code-draft's weights stored in bfloat16 with a model card beside them, as the
    training script writes a float model (made once)."""
    out = tmp_path_factory.getbasetemp() / FLOAT_DRAFT.name
    if not out.is_dir():
        if not CODE_DRAFT.is_dir():
            pytest.skip(f"{CODE_DRAFT} is not present")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(CODE_DRAFT).to(torch.bfloat16)
        model.generation_config.eos_token_id = [0]
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(CODE_DRAFT).save_pretrained(out)
        (out / "README.md").write_text("# code-draft in bfloat16\n")
    return out


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test packs into a weight cache of its own (no entry of another run helps)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "300",
           "XDG_CACHE_HOME": str(cache)}
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


# --- the tool ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_the_tool_writes_quantizes_codes_and_keeps_the_rest(written, fmt, tmp_path_factory):
    """Each matrix's codes are quant.quantize's (4-bit two a byte; the output matrix,
    here the tied embeddings, in q8_0 beside a 4-bit format), its scales those in
    float16; the norms, the tokenizer files and the model card are the source's bytes."""
    out = written(FLOAT_DRAFT, fmt)
    folder = float_draft(tmp_path_factory)
    source = load_file(str(folder / "model.safetensors"))
    stored = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    matrices = sorted(n for n, t in source.items() if t.dim() == 2)
    assert "lm_head.weight" not in source  # tied: the embeddings are the output matrix
    others = {"model.embed_tokens": "q8_0"} if quant.FORMATS[fmt].bits == 4 else {}
    assert config == {"quant_method": "genlab", "format": fmt,
                      "block": quant.FORMATS[fmt].block,
                      "modules": [n.removesuffix(".weight") for n in matrices],
                      **({"module_formats": others} if others else {})}
    for name in matrices:
        its = others.get(name.removesuffix(".weight"), fmt)
        codes, scales = quant.quantize(source[name].float(), its)
        got = stored[name + ".qcodes"]
        if quant.FORMATS[its].bits == 4:
            assert got.shape == (codes.shape[0], codes.shape[1] // 2)
            got = torch.stack([got & 15, got >> 4], dim=2).reshape(codes.shape)
        assert got.dtype == codes.dtype and torch.equal(got, codes), name
        assert stored[name + ".qscales"].dtype == torch.float16
        assert torch.equal(stored[name + ".qscales"], scales.half()), name
    for name in set(source) - set(matrices):
        assert torch.equal(stored[name], source[name]) and stored[name].dtype == torch.bfloat16
    assert set(stored) == {n + s for n in matrices for s in (".qcodes", ".qscales")} \
        | (set(source) - set(matrices))
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "README.md"):
        assert (out / file).read_bytes() == (folder / file).read_bytes()
    assert folder_bytes(out) < folder_bytes(folder)


def test_the_tool_is_byte_reproducible(tmp_path, tmp_path_factory):
    """Two runs of the script on one source write the same bytes, file for file."""
    runs = []
    source = float_draft(tmp_path_factory)
    for name in ("a", "b"):
        done = subprocess.run([sys.executable, "scripts/quantize_model.py", str(source),
                               str(tmp_path / name), "--format", "nf4"],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "matrices in nf4" in done.stderr
        runs.append({f.name: f.read_bytes() for f in (tmp_path / name).iterdir()})
    assert runs[0] == runs[1] and "model.safetensors" in runs[0]


def test_the_tool_refuses_a_quantized_source_and_a_full_folder(written, tmp_path,
                                                              tmp_path_factory):
    for source, out, said in ((written(FLOAT_DRAFT, "q8_0"), tmp_path / "x",
                               "quantized already"),
                              (float_draft(tmp_path_factory), written(FLOAT_DRAFT, "nf4"),
                               "not an empty folder")):
        done = subprocess.run([sys.executable, "scripts/quantize_model.py", str(source),
                               str(out), "--format", "q8_0"],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 2 and said in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


# --- loading and running ----------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["q8_0", "nf4"])
@pytest.mark.parametrize("source", [CODE_TARGET, FLOAT_DRAFT], ids=["code-target", "bf16"])
def test_native_greedy_tokens_are_the_dequantized_forwards(written, source, fmt,
                                                           monkeypatch):
    """64 greedy tokens: the native kernel over the stored codes (auto picks it; nothing
    quantizes again) against the lean forward over transformers' model of the
    dequantized float32 weights (the load that never lets transformers read the codes)."""
    folder = written(source, fmt)
    lm = load_model(ModelSpec(str(folder)), quick=True)
    assert lm.stored is not None and lm.stored.format == fmt and lm.weights is None

    def no_quantizing(*args, **kwargs):
        raise AssertionError("the stored codes were quantized again")

    with monkeypatch.context() as patched:
        patched.setattr(quant, "quantize", no_quantizing)
        backend = choose_backend(lm, Request())  # packs the kernel's weights
    named = fmt if fmt == "q8_0" else f"{fmt}, output matrix q8_0"
    assert backend.name == "native" and f"weights {named} as stored" in backend.reason
    step = native_step(lm.lean, fmt)
    ids = lm.encode(PROMPT)
    reference = load_model(ModelSpec(str(folder)), quick=False).model
    assert reference.dtype == torch.float32
    want = greedy_lean(LeanLlama.from_model(reference), ids, 64)
    assert greedy_native(step, lm.lean, ids, 64) == want


def test_a_4bit_checkpoint_whose_config_hides_the_q8_0_output_matrix_is_refused(
        written, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(written(FLOAT_DRAFT, "nf4"), folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]["module_formats"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model.embed_tokens.weight is stored as "
                                             "int8 codes and float16 scales, and nf4 is"):
        load_model(ModelSpec(str(folder)), quick=True)


def test_a_4bit_checkpoint_runs_its_output_matrix_as_stored(written):
    """The tool stores a 4-bit checkpoint's output matrix (here the tied embeddings) in
    q8_0 and the kernel runs it so, however the model loaded (transformers' model names
    an lm_head, the quick load the embeddings), with the same tokens; a checkpoint
    written before, its output matrix in 4 bits (the built-in code-small), still runs
    that matrix in 4 bits."""
    from genlib.backends import kernel
    from genlib.backends.fit import lean_of

    for folder, head in ((written(FLOAT_DRAFT, "nf4"), "q8_0"),
                         (ROOT / "genlib/assets/code-small", "nf4")):
        tokens = []
        for quick in (True, False):
            lm = load_model(ModelSpec(str(folder)), quick=quick)
            assert (lm.lean is None) is not quick
            lean = lean_of(lm)
            assert kernel.head_format(lean, "nf4") == head
            step = kernel.NativeStep(lean, 1, weights="nf4")
            assert step.head_weights == head
            named = "nf4" if head == "nf4" else "nf4, output matrix q8_0"
            assert choose_backend(lm, Request(rows=1)).reason == \
                f"an nf4 checkpoint: weights {named} as stored"
            cache, token, ids = lean.new_cache(16), 1, []
            for _ in range(8):
                token = int(step(token, cache).argmax())
                ids.append(token)
            tokens.append(ids)
        assert tokens[0] == tokens[1], folder


def test_a_batch_after_transformers_load_packs_the_codes_as_stored(written, monkeypatch):
    """A model loaded through transformers (batches, beam search) still runs its stored
    codes on the native kernel, every row: nothing quantizes the dequantized weights."""
    lm = load_model(ModelSpec(str(written(FLOAT_DRAFT, "q8_0"))), quick=False)
    assert lm.lean is None and lm.stored is not None

    def no_quantizing(*args, **kwargs):
        raise AssertionError("the stored codes were quantized again")

    with monkeypatch.context() as patched:
        patched.setattr(quant, "quantize", no_quantizing)
        backend = choose_backend(lm, Request(rows=3))
    assert backend.name == "native" and "weights q8_0 as stored" in backend.reason


def test_the_first_token_dequantizes_no_matrix_of_the_layers(written):
    """The native kernel runs the codes; the torch forward's float copies of the layers'
    matrices (`LeanLlama.layers`) are never made, and the layers' matrices never
    dequantized, for a generation on it."""
    from genlib.generate import generate
    from genlib.settings.config import resolve_settings

    lm = load_model(ModelSpec(str(written(FLOAT_DRAFT, "nf4"))), quick=True)
    generate(lm, [lm.encode("def f(")], resolve_settings({"max_new_tokens": 2}))
    assert "layers" not in lm.lean.__dict__
    read = set(lm.lean.tensors._done)  # the dequantized tensors, by name
    assert not any(".self_attn." in name or ".mlp.gate" in name for name in read), read


def test_transformers_model_holds_the_dequantized_weights(written):
    folder = written(FLOAT_DRAFT, "q8_0")
    model = load_model(ModelSpec(str(folder)), quick=False).model
    stored = qformat.open_folder(folder)
    assert not hasattr(model.config, "quantization_config")
    for name, tensor in model.state_dict().items():
        want = stored.dequantized_tensors(torch.float32)[
            "model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert torch.equal(tensor, want), name


def test_every_backend_runs_the_folder_and_reports_format_and_size(written, tmp_path):
    """--json and --stats name the format and the folder's bytes; lean and transformers
    give the native kernel's greedy tokens on the dequantized weights."""
    folder = written(FLOAT_DRAFT, "q8_0")
    tokens = {}
    for backend in ("auto", "lean", "transformers"):
        done = cli("generate", "-m", str(folder), "def f(", "-n", "24", "--json",
                   "--backend", backend, cache=tmp_path)
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["model_files"] == {"weights": "q8_0", "bytes": folder_bytes(folder)}
        tokens[backend] = doc["outputs"][0]["token_ids"]
    assert tokens["auto"] == tokens["lean"] == tokens["transformers"]
    done = cli("generate", "-m", str(folder), "def f(", "-n", "2", "--stats", cache=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "backend native (a q8_0 checkpoint: weights q8_0 as stored)" in done.stderr
    assert f"weights q8_0, {folder_bytes(folder) / 1e6:.1f} MB on disk" in done.stderr


# --- broken folders ----------------------------------------------------------------------

def drop_scales(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight.qscales"]
    save_file(tensors, str(folder / "model.safetensors"))


def int_scales(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight.qscales"
    tensors[name] = tensors[name].view(torch.int16)
    save_file(tensors, str(folder / "model.safetensors"))


def edit_config(**changes):
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


DAMAGES = {"scales missing": (drop_scales, "has no model.layers.1.mlp.up_proj.weight.qscales"),
           "scales int16": (int_scales, "stored as int8 codes and int16 scales"),
           "unknown format": (edit_config(format="q3_k"), "names format 'q3_k'"),
           "wrong block": (edit_config(block=64), "blocks of 64 weights"),
           "unknown module format": (edit_config(module_formats={"model.embed_tokens": "q3_k"}),
                                     "has `module_formats`"),
           "module format for a layer": (
               edit_config(module_formats={"model.layers.0.mlp.up_proj": "q8_0"}),
               "it may give only the output matrix")}


def broken_copy(source: Path, folder: Path, damage: str) -> Path:
    folder.mkdir()
    for file in source.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    DAMAGES[damage][0](folder)
    return folder


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("quick", [True, False], ids=["quick", "transformers"])
def test_a_broken_folder_is_refused_before_any_backend(written, tmp_path, damage, quick):
    folder = broken_copy(written(FLOAT_DRAFT, "q8_0"), tmp_path / "broken", damage)
    with pytest.raises(ModelLoadError, match="^cannot load ") as refusal:
        load_model(ModelSpec(str(folder)), quick=quick)
    assert DAMAGES[damage][1] in str(refusal.value) and "\n" not in str(refusal.value)


@pytest.mark.parametrize("damage, backend", [("scales missing", "auto"),
                                             ("unknown format", "transformers")])
def test_a_broken_folder_is_one_line_and_exit_2(written, tmp_path, damage, backend):
    folder = broken_copy(written(FLOAT_DRAFT, "q8_0"), tmp_path / "broken", damage)
    done = cli("generate", "-m", str(folder), "def f(", "-n", "2", "--backend", backend,
               cache=tmp_path / "cache")
    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot load") and DAMAGES[damage][1] in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


def test_quantizing_a_stored_checkpoint_again_is_refused(written, tmp_path):
    done = cli("generate", "-m", str(written(FLOAT_DRAFT, "nf4")), "x", "--quantize", "8bit",
               cache=tmp_path)
    assert done.returncode == 2
    assert "stored quantized already (nf4); drop --quantize 8bit" in done.stderr


# --- the built-in models -----------------------------------------------------------------

def stored_format(folder: Path) -> str:
    """How the folder stores its matrices, read here without genlab's reader."""
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        return config["quantization_config"]["format"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        kinds = {f.get_slice(n).get_dtype() for n in f.keys()
                 if len(f.get_slice(n).get_shape()) == 2}
    return {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}[kinds.pop()]


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_the_built_in_models_load_offline_and_report_format_and_size(name, tmp_path):
    done = cli("generate", "-m", name, "def f(", "-n", "1", "--json", cache=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    folder = BUILTIN_MODELS[name]
    assert doc["model"] == name and doc["backend"]["name"] == "native"
    assert doc["model_files"] == {"weights": stored_format(folder),
                                  "bytes": folder_bytes(folder)}
