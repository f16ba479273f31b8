"""genlib.models.quickload: checkpoints loaded without transformers behave exactly as the same
checkpoints loaded through it (tokens, logits, tokenizer, end ids), fall back to
transformers for what they do not qualify for, and keep transformers out of
`genlab generate`'s start."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genlib import generate
from genlib.backends.lean import lean_model_of
from genlib.backends.llama import LeanLlama
from genlib.models.loading import DEFAULT_MODEL, ModelSpec, load_model
from genlib.models.quickload import quick_load as load_quickly
from genlib.settings.config import resolve_settings
from tests.conftest import (
    CODE_TARGET,
    LLAMA2XS,
    ROOT,
    STORIES,
    assert_lean_follows_transformers,
    tiny_config,
)

MODELS = [STORIES, LLAMA2XS, CODE_TARGET, DEFAULT_MODEL]
TEXTS = ["Once upon a time", " leading space", "two\n\nlines  and  spaces", "",
         "def f(x):\n    return x * 2\n", "ünïcödé 😀 日本語", "a\tb\r\nc", "</s> and <s> inline",
         "<|endoftext|>print(1)"]


def both(path: Path):
    if not path.is_dir():
        pytest.skip(f"{path} is not present")
    spec = ModelSpec(str(path))
    return load_model(spec, quick=True), load_model(spec)


def no_transformers_model():
    raise AssertionError("the transformers model was loaded")


def quick_load(spec: ModelSpec, folder: str, device: torch.device):
    """genlib.models.quickload.quick_load, its transformers model never to be loaded here."""
    return load_quickly(spec, folder, device, no_transformers_model)


def greedy(n: int, **more):
    return resolve_settings({"max_new_tokens": n, **more})


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_quick_load_gives_the_same_tokens_facts_and_tokenizer(path):
    quick, full = both(path)
    # a start after the first serves the tokenizer from its cache entry (see
    # tests/test_tokenizer_cache.py), with transformers' own behind it
    assert quick.lean is not None and \
        type(getattr(quick.tokenizer, "full", quick.tokenizer)) is type(full.tokenizer)
    assert (quick.eos_ids, quick.pad_id, quick.max_positions, quick.dtype, quick.vocab_size) \
        == (full.eos_ids, full.pad_id, full.max_positions, full.dtype, full.vocab_size)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(quick.tokenizer, attr) == getattr(full.tokenizer, attr), attr
    for text in TEXTS:
        for special in (True, False):
            ids = quick.tokenizer(text, add_special_tokens=special)["input_ids"]
            assert ids == full.tokenizer(text, add_special_tokens=special)["input_ids"], text
        ids = full.encode(text)
        for skip in (True, False):
            for part in (ids, ids[1:], ids[2:]):
                assert quick.tokenizer.decode(part, skip_special_tokens=skip,
                                              clean_up_tokenization_spaces=False) \
                    == full.tokenizer.decode(part, skip_special_tokens=skip,
                                             clean_up_tokenization_spaces=False)
    prompt = full.encode("Once upon a time" if "stories" in path.name or "xs" in path.name
                         else "def fibonacci(n):\n    ")
    forced = greedy(40, ignore_eos=True)
    ours = generate.generate(quick, [prompt], forced)[0]
    assert ours.token_ids == generate.generate(full, [prompt], forced)[0].token_ids
    sampled = greedy(30, do_sample=True, temperature=0.9, top_k=40, seed=7)
    assert generate.generate(quick, [prompt], sampled)[0].text \
        == generate.generate(full, [prompt], sampled)[0].text
    assert not quick.model_loaded  # a single row never needed transformers' model


def test_quick_logits_are_bit_identical_to_transformers(stories):
    quick = load_model(ModelSpec(str(STORIES)), quick=True)
    assert_lean_follows_transformers(stories.model, lean_model_of(quick),
                                     torch.tensor([stories.encode("The little dog")]))


def test_what_the_lean_path_cannot_do_loads_transformers_on_first_use(stories):
    """Batches and beams run on the native kernel over the quick-loaded weights, without
    transformers' model (where the kernel builds); transformers' forward, asked for,
    loads it on first use; the tokens are the same either way."""
    from genlib.backends import kernel

    quick = load_model(ModelSpec(str(STORIES)), quick=True)
    prompts = [stories.encode("Once upon a time"), stories.encode("The dog")]
    settings = greedy(20, ignore_eos=True)
    expected = [r.token_ids for r in generate.generate(stories, prompts, settings,
                                                       backend="transformers")]
    assert not quick.model_loaded
    batch = generate.generate(quick, prompts, settings)  # two rows
    assert quick.model_loaded == (kernel.build().library is None)
    assert [r.token_ids for r in batch] == expected
    again = generate.generate(quick, prompts, settings, backend="transformers")
    assert quick.model_loaded
    assert [r.token_ids for r in again] == expected
    beam = greedy(20, num_beams=3)
    assert generate.generate(quick, prompts[:1], beam)[0].token_ids \
        == generate.generate(stories, prompts[:1], beam, backend="transformers")[0].token_ids
    assert quick.tokenizer.get_vocab() == stories.tokenizer.get_vocab()


def test_loading_the_deferred_model_is_not_timed_as_prefill(stories):
    import time

    quick = load_model(ModelSpec(str(STORIES)), quick=True)
    load = quick.deferred

    def slow_load():
        time.sleep(0.5)
        return load()

    quick.deferred = slow_load
    events = list(generate.stream(quick, [stories.encode("Once upon a time")] * 2,
                                  greedy(5, ignore_eos=True), backend="transformers"))
    prefill = next(e for e in events if type(e).__name__ == "Prefill")
    assert quick.model_loaded and prefill.seconds < 0.4


def save_tiny(tmp_path: Path, arch: str = "llama", tokenizer: Path = STORIES, **config) -> Path:
    """A tiny random model of `arch` saved with a shared model's tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(arch)
    for key, value in config.items():
        setattr(cfg, key, value)
    folder = tmp_path / arch
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def code_tiny(tmp_path: Path) -> Path:
    """A tiny llama with code-target's byte-level tokenizer (TokenizersBackend)."""
    return save_tiny(tmp_path, tokenizer=CODE_TARGET, vocab_size=8192, bos_token_id=0,
                     eos_token_id=0)


def edit_json(path: Path, **changes) -> None:
    """Set keys (None drops one)."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def edit_tokenizer_json(folder: Path, change) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    change(data)
    (folder / "tokenizer.json").write_text(json.dumps(data))


def assert_same_as_transformers(folder: Path) -> None:
    """The quick load of `folder` is taken, and matches transformers' load in everything
    genlab reads: facts, tokenizer class and output, logits."""
    quick, full = load_model(ModelSpec(str(folder)), quick=True), load_model(ModelSpec(str(folder)))
    assert quick.lean is not None and not quick.model_loaded
    assert type(getattr(quick.tokenizer, "full", quick.tokenizer)) is type(full.tokenizer)
    assert (quick.eos_ids, quick.pad_id, quick.max_positions, quick.vocab_size) \
        == (full.eos_ids, full.pad_id, full.max_positions, full.vocab_size)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(quick.tokenizer, attr) == getattr(full.tokenizer, attr), attr
    for text in TEXTS + [" leading  space", "</s>hello", "hello  world"]:
        ids = full.tokenizer(text)["input_ids"]
        assert quick.tokenizer(text)["input_ids"] == ids, text
        for skip in (True, False):
            assert quick.tokenizer.decode(ids, skip_special_tokens=skip) \
                == full.tokenizer.decode(ids, skip_special_tokens=skip)
    # The lean forward over the quick load's tensors is the one genlab builds over
    # transformers' model, bit for bit (tests/test_lean.py compares that one with
    # transformers' forward).
    reference = LeanLlama.from_model(full.model)
    ids = torch.tensor([[1, 5, 9, 200, 33]])
    ours, theirs = quick.lean.new_cache(64), reference.new_cache(64)
    assert torch.equal(quick.lean.prefill(ids, ours), reference.prefill(ids, theirs))
    for token in (17, 3, 99):
        t = torch.tensor([[token]])
        assert torch.equal(quick.lean.step(t, ours), reference.step(t, theirs))


def no_special_names(folder: Path) -> None:
    edit_json(folder / "tokenizer_config.json", bos_token=None, eos_token=None,
              unk_token=None, extra_special_tokens=None)


def names_plain_token_special(folder: Path) -> None:
    edit_json(folder / "tokenizer_config.json", extra_special_tokens=["<s>", "</s>", "▁Once"])


def llama2_normalizer(folder: Path) -> None:
    def change(data):
        data["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        data["pre_tokenizer"] = None
    edit_tokenizer_json(folder, change)


def no_byte_fallback(folder: Path) -> None:
    edit_tokenizer_json(folder, lambda data: data["model"].update(byte_fallback=False))


def special_tokens_map(folder: Path) -> None:
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<unk>"}))


def no_eos_in_config(folder: Path) -> None:
    edit_json(folder / "config.json", eos_token_id=None, bos_token_id=None)


def null_eos_in_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))


def null_kv_heads(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_key_value_heads": None,
                                                     "head_dim": None}))


@pytest.mark.parametrize("arch, config", [("llama", {}), ("llama", {"tie_word_embeddings": True})],
                         ids=["gqa", "tied"])
def test_tiny_checkpoints_match_transformers(tmp_path, arch, config):
    folder = save_tiny(tmp_path, arch, **config)
    assert quick_load(ModelSpec(str(folder)), str(folder), torch.device("cpu")).lean.kv_heads == 2
    assert_same_as_transformers(folder)


@pytest.mark.parametrize("change", [
    no_special_names, names_plain_token_special, llama2_normalizer, no_byte_fallback,
    special_tokens_map, no_eos_in_config, null_eos_in_config])
def test_tokenizer_and_config_variants_load_as_transformers_loads_them(tmp_path, change):
    """transformers' tokenizer class rebuilds or amends tokenizer.json (LlamaTokenizer's
    own pipeline, special tokens named only in the configs), and LlamaConfig fills
    defaults: the quick load must follow both."""
    folder = save_tiny(tmp_path)
    change(folder)
    assert_same_as_transformers(folder)


def test_null_kv_heads_and_head_dim_are_derived_as_llamaconfig_derives_them(tmp_path):
    folder = save_tiny(tmp_path, num_key_value_heads=4)
    null_kv_heads(folder)
    assert_same_as_transformers(folder)


def test_byte_level_tokenizer_declared_as_llama_gets_tokenizers_backend(tmp_path):
    folder = code_tiny(tmp_path)
    edit_json(folder / "tokenizer_config.json", tokenizer_class="LlamaTokenizer")
    assert_same_as_transformers(folder)
    folder = code_tiny(tmp_path / "special")
    edit_tokenizer_json(folder, lambda data: data.update(added_tokens=[]))
    assert_same_as_transformers(folder)


@pytest.mark.parametrize("change", [
    lambda f: edit_json(f / "tokenizer_config.json", tokenizer_class="GPT2Tokenizer"),
    lambda f: edit_json(f / "tokenizer_config.json", auto_map={"AutoTokenizer": ["x", "y"]}),
    lambda f: edit_json(f / "config.json", rope_parameters={"rope_type": "linear",
                                                            "rope_theta": 10000.0,
                                                            "factor": 2.0}),
    lambda f: edit_json(f / "config.json", rope_parameters={"type": "linear",
                                                            "rope_theta": 10000.0,
                                                            "factor": 2.0}),
    lambda f: edit_json(f / "config.json", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    lambda f: edit_json(f / "config.json", intermediate_size=48),  # shapes disagree
    lambda f: edit_json(f / "config.json", vocab_size=512.0),
    lambda f: edit_json(f / "config.json", hidden_size=30),  # not a multiple of the heads
    lambda f: edit_json(f / "config.json", tie_word_embeddings=True),  # with an lm_head
    lambda f: edit_json(f / "config.json", transformers_weights="other.safetensors"),
    lambda f: edit_json(f / "config.json", model_name="phi3"),
    lambda f: edit_json(f / "config.json", initializer_range=2.0),
    lambda f: edit_json(f / "config.json", bos_token_id="1"),
    lambda f: edit_json(f / "config.json", rms_norm_eps=0),
    lambda f: edit_json(f / "config.json", head_dim=7),
    lambda f: edit_json(f / "config.json", architectures=5),
    lambda f: edit_json(f / "config.json", max_position_embeddings=10**11),
    lambda f: (f / "generation_config.json").write_text("[1, 2]"),
    lambda f: edit_json(f / "generation_config.json", generator={"a": 1}),
    lambda f: edit_json(f / "generation_config.json", eos_token_id=2.0),
    lambda f: (f / "adapter_config.json").write_text("{}"),
    lambda f: (f / "tokenizer.json").write_text('{"model": 3}'),
    lambda f: (f / "tokenizer.json").unlink(),
    lambda f: (f / "model.safetensors").rename(f / "model-00001-of-00001.safetensors"),
], ids=["tokenizer-class", "remote-tokenizer", "rope-scaling", "rope-legacy-type",
        "rope-scaling-key", "shapes", "float-vocab", "bad-heads", "tied-with-lm-head",
        "weights-elsewhere", "model-name", "initializer-range", "string-bos", "zero-eps",
        "odd-head-dim", "architectures-int", "huge-positions", "generation-list",
        "generation-dict-value", "float-eos", "adapter", "broken-tokenizer-json",
        "no-tokenizer-json", "no-single-file"])
def test_checkpoints_that_do_not_qualify_load_through_transformers(tmp_path, change):
    folder = save_tiny(tmp_path)
    spec, cpu = ModelSpec(str(folder)), torch.device("cpu")
    assert quick_load(spec, str(folder), cpu) is not None  # qualifies until changed
    change(folder)
    assert quick_load(spec, str(folder), cpu) is None


def test_other_architectures_load_through_transformers(tmp_path):
    folder = save_tiny(tmp_path, "qwen2")  # AutoTokenizer overrides qwen2's declared class
    assert quick_load(ModelSpec(str(folder)), str(folder), torch.device("cpu")) is None


@pytest.mark.parametrize("spec", [
    ModelSpec(str(STORIES), quantize="8bit", backend="transformers"),
    ModelSpec(str(STORIES), trust_remote_code=True)])
def test_bitsandbytes_or_remote_code_specs_do_not_qualify(spec):
    assert quick_load(spec, spec.ref, torch.device("cpu")) is None


def test_the_native_kernels_quantization_starts_quickly_in_float32():
    spec = ModelSpec(str(STORIES), quantize="8bit")
    lm = quick_load(spec, spec.ref, torch.device("cpu"))
    assert (lm.weights, lm.quantize, lm.dtype) == ("q8_0", "8bit", torch.float32)


def test_repr_and_equality_do_not_load_the_deferred_model():
    quick = load_model(ModelSpec(str(STORIES)), quick=True)
    assert "stories260K" in repr(quick) and quick == quick
    assert not quick.model_loaded


def test_genlab_lean_0_turns_the_quick_start_off(monkeypatch):
    monkeypatch.setenv("GENLAB_LEAN", "0")
    lm = load_model(ModelSpec(str(STORIES)), quick=True)
    assert lm.lean is None and lm.model_loaded


def test_chat_templates_come_from_transformers_tokenizer(tmp_path):
    folder = save_tiny(tmp_path, "llama")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    quick, full = load_model(ModelSpec(str(folder)), quick=True), load_model(ModelSpec(str(folder)))
    messages = [{"role": "user", "content": "Tell me a story"}]
    assert quick.tokenizer.chat_template
    assert quick.encode_chat(messages) == full.encode_chat(messages)


@pytest.mark.parametrize(("command", "shown"), [
    (["generate", "-n", "8", "Once upon a time"], ", there was a little"),
    (["beam", "-k", "2", "-n", "8", "Once upon a time"], ", there was a little"),
    (["compare", "-n", "8", "-p", "greedy", "-p", "beam", "Once upon a time"], "there was"),
    (["speculate", "--draft-model", str(STORIES), "-n", "8", "Once upon a time"],
     ", there was a little"),
    (["explain", "-n", "2", "Once upon a time"], "step 0: chose ','"),
], ids=lambda c: c[0] if isinstance(c, list) else "")
def test_a_command_starts_without_transformers_model_modules(command, shown):
    heavy = ("transformers.modeling_utils", "transformers.models.llama.configuration_llama",
             "transformers.integrations.hub_kernels")
    code = ("import sys\nfrom cli.main import app\n"
            "try:\n    app(sys.argv[2:3] + ['-m', sys.argv[1]] + sys.argv[3:])\n"
            "except SystemExit as exit:\n"
            f"    print(any(m in sys.modules for m in {heavy!r}), exit.code, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code, str(STORIES), *command],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert shown in done.stdout, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False 0"


def test_a_batch_of_several_rows_starts_without_transformers_model_modules(tmp_path):
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"prompt": p}) + "\n"
                             for p in ("Once upon a time", "The cat", "Tom had")))
    heavy = ("transformers.modeling_utils", "transformers.models.llama.configuration_llama")
    code = ("import sys\nfrom cli.main import app\n"
            "try:\n    app(['generate', '-m', sys.argv[1], '-n', '8', '--batch-size', '3',\n"
            "         '--input', sys.argv[2], '--output', sys.argv[3]])\n"
            "except SystemExit as exit:\n"
            f"    print(any(m in sys.modules for m in {heavy!r}), exit.code, file=sys.stderr)\n")
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-c", code, str(STORIES), str(lines), str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "False 0"
    assert len(out.read_text().splitlines()) == 3
