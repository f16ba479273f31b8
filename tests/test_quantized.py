"""Quantized weights in the native kernel (genlib/backends/quant.py, the q8_0, nf4 and
q4_0 builds of csrc/lean_step.c): each format's blocks against a NumPy reference, the
kernel's products against the lean forward over the dequantized weights, greedy tokens
on the real models, and batches, beam search and speculation on quantized weights
against their unbatched and plain runs; and where `--quantize` runs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from genlib.backends import kernel, quant
from genlib.backends.llama import LeanLlama
from tests.test_native import PORTABLE, assert_native_follows_lean, odd_llama, tiny

FORMATS = list(quant.FORMATS)
NF4 = np.array(quant.NF4, dtype=np.float32)


# --- the formats, against NumPy ---------------------------------------------------------

def numpy_quantize(w: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Block by block, as llama.cpp's quantize_row_q8_0_ref / q4_0_ref and bitsandbytes'
    NF4 describe them: codes (out, in) and scales (out, blocks)."""
    block = quant.FORMATS[name].block
    rows, columns = w.shape
    codes = np.zeros((rows, columns), dtype=np.int64)
    scales = np.zeros((rows, -(-columns // block)), dtype=np.float32)
    for r in range(rows):
        for b, start in enumerate(range(0, columns, block)):
            x = w[r, start:start + block]
            if name == "q8_0":
                d = np.float32(np.abs(x).max() / np.float32(127))
                q = np.round(x / d) if d else np.zeros_like(x)
            elif name == "nf4":
                q, d = numpy_nf4(x)
            else:
                d = np.float32(x[np.abs(x).argmax()] / np.float32(-8))
                q = np.minimum(15, np.trunc(x * (np.float32(1) / d) + np.float32(8.5))) \
                    if d else np.full(len(x), 8)
            codes[r, start:start + block], scales[r, b] = q, d
    return codes, scales


def numpy_nf4(x: np.ndarray, shares=quant.NF4_SEARCH) -> tuple[np.ndarray, np.float32]:
    """A block's NF4 codes and scale: of the candidate scales (shares of its absmax),
    the nearest levels' least-squares scale of least squared error, the first on a tie."""
    best = None
    for share in shares:
        d = np.float32(np.abs(x).max() * np.float32(share))
        q = np.abs((x * (np.float32(1) / d))[:, None] - NF4).argmin(axis=1) if d \
            else np.full(len(x), 7)
        level = NF4[q].astype(np.float64)
        fit, size = (x.astype(np.float64) * level).sum(), (level * level).sum()
        scale = fit / size if size else 0.0
        if best is None or fit * scale > best[0]:
            best = (fit * scale, q, np.float32(scale))
    return best[1], best[2]


def numpy_dequantize(codes: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
    block = quant.FORMATS[name].block
    if name == "nf4":
        values = NF4[codes]
    else:
        values = codes.astype(np.float32) - (8 if name == "q4_0" else 0)
    return values * np.repeat(scales, block, axis=1)[:, :codes.shape[1]]


@pytest.mark.parametrize("name", FORMATS)
def test_each_block_quantizes_and_dequantizes_as_the_numpy_reference(name):
    """70 columns: whole blocks and a short last one; a row of zeros; one large weight."""
    torch.manual_seed(0)
    w = torch.randn(5, 70)
    w[1] = 0
    w[2, 3] = 40.0
    codes, scales = quant.quantize(w, name)
    want_codes, want_scales = numpy_quantize(w.numpy(), name)
    np.testing.assert_allclose(scales.numpy(), want_scales, rtol=1e-6)
    # rounding exactly at a half can fall either way in float32: at most one code apart
    assert np.abs(codes.numpy().astype(np.int64) - want_codes).max() <= 1
    assert (codes.numpy().astype(np.int64) != want_codes).mean() < 0.01
    back = quant.dequantize(codes, scales, name).numpy()
    np.testing.assert_array_equal(back, numpy_dequantize(codes.numpy().astype(np.int64),
                                                        scales.numpy(), name))
    if name == "nf4":  # each block no further from its weights than absmax's codes
        absmax = numpy_dequantize(*numpy_quantize_absmax_nf4(w.numpy()), "nf4")
        ours, theirs = block_errors(back, w.numpy()), block_errors(absmax, w.numpy())
        assert (ours <= theirs).all()
        plain = [0, 3, 4]  # rows without the outlier (row 2) or zeros (row 1)
        assert ours[plain].sum() < 0.9 * theirs[plain].sum()
        return
    # within half a step of the weight, the format's bound (q4_0: one step, for weights
    # of the sign opposite its largest, which clip at +7 where that one is -8)
    step = {"q8_0": 1.0, "q4_0": 2.0}[name]
    bound = np.repeat(np.abs(scales.numpy()), quant.FORMATS[name].block, axis=1)[:, :70]
    assert (np.abs(back - w.numpy()) <= step / 2 * bound + 1e-6).all()


def numpy_quantize_absmax_nf4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bitsandbytes' NF4: each block's absmax its scale, each weight the nearest level."""
    blocks = [w[:, i:i + 64] for i in range(0, w.shape[1], 64)]
    scales = np.stack([np.abs(b).max(axis=1) for b in blocks], axis=1)
    codes = np.concatenate([np.abs((b / np.where(d, d, 1)[:, None])[..., None] - NF4)
                            .argmin(axis=-1) for b, d in zip(blocks, scales.T)], axis=1)
    return codes, scales.astype(np.float32)


def block_errors(back: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Each nf4 block's squared error (rows, blocks)."""
    square = (back.astype(np.float64) - w) ** 2
    return np.stack([square[:, i:i + 64].sum(axis=1) for i in range(0, w.shape[1], 64)], 1)


def test_the_kernels_nf4_encoder_gives_the_same_codes_and_scales():
    """genlab_nf4_quantize (what a load packs with) against quant.quantize, bit for bit:
    whole and short blocks, zero rows, an outlier, weights of every magnitude."""
    built = kernel.build_for("nf4")
    if built.library is None:
        pytest.skip(built.reason)
    torch.manual_seed(3)
    rows = quant.NF4_ROWS + 30  # PyTorch's slices of rows, a short one last
    w = torch.randn(rows, 300) * torch.logspace(-4, 2, 300)
    w[5] = 0
    w[9, 17] = 1e4
    w[11] = w[11].to(torch.bfloat16).float()  # many equal weights: ties between candidates
    codes, scales = kernel.quantize(w, "nf4")
    want_codes, want_scales = quant.quantize(w, "nf4")
    assert (codes.shape, scales.shape) == ((rows, 300), (rows, 5))
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert torch.equal(kernel.quantize(w, "q4_0")[1], quant.quantize(w, "q4_0")[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", FORMATS)
def test_a_weight_no_scale_stands_for_is_refused(name, bad):
    w = torch.randn(4, 64)
    w[2, 7] = bad
    for encode in (quant.quantize, kernel.quantize):
        with pytest.raises(quant.NonFiniteWeights, match=f"NaN or infinite weights, which "
                                                         f"{name} cannot quantize"):
            encode(w, name)


@pytest.mark.parametrize("name", FORMATS)
def test_packing_lays_out_panels_of_blocks_scales_first(name):
    """Panel 1's second block of a (40, 70) matrix, read back from the packed bytes."""
    torch.manual_seed(1)
    w = torch.randn(40, 70)
    panel, fmt = 16, quant.FORMATS[name]
    packed = quant.pack(w, panel, name)
    assert packed.dtype == torch.uint8 and packed.numel() == quant.packed_bytes(40, 70, 16, name)
    codes, scales = quant.quantize(w, name)
    column_bytes = panel * fmt.bits // 8
    panel_bytes = quant.packed_bytes(16, 70, 16, name)
    start = panel_bytes + panel * 4 + fmt.block * column_bytes  # panel 1, block 1
    got_scales = packed[start:start + panel * 4].view(torch.float32)
    torch.testing.assert_close(got_scales, scales[16:32, 1], rtol=0, atol=0)
    column = packed[start + panel * 4:start + panel * 4 + column_bytes]  # its first column
    want = codes[16:32, fmt.block].view(torch.uint8)
    if fmt.bits == 4:
        want = want[:8] | (want[8:] << 4)
    assert column.tolist() == want.tolist()
    last = packed[2 * panel_bytes:]  # panel 2: rows 32-39, then 8 zero rows
    assert last[:panel * 4].view(torch.float32)[8:].eq(0).all()


# --- the kernel's products ----------------------------------------------------------------

def dequantized(model, name: str):
    """A copy of `model` whose projections and lm_head hold their quantized values (in
    float32, the lm_head untied): what the kernel's `name` matrices stand for, the
    lm_head in its own format (q8_0 under a 4-bit one)."""
    from transformers.pytorch_utils import Conv1D

    def stands_for(weight: torch.Tensor, fmt: str = name) -> torch.Tensor:  # (out, in)
        return quant.dequantize(*quant.quantize(weight, fmt), fmt)

    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
        for module in copied.modules():
            if module is copied.lm_head:
                module.weight.copy_(stands_for(module.weight, quant.output_format(name)))
            elif type(module) is torch.nn.Linear:
                module.weight.copy_(stands_for(module.weight))
            elif type(module) is Conv1D:  # gpt2's: stored [in, out]
                module.weight.copy_(stands_for(module.weight.t().contiguous()).t())
    return copied


def quantized_build(name: str, flags: tuple[str, ...] = ()):
    build = kernel.build(kernel.FLAGS + flags + kernel.WEIGHTS[name])
    if build.library is None:
        pytest.skip(f"no {name} build here: {build.reason}")
    return build.library


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("flags", list(PORTABLE.values()), ids=list(PORTABLE))
@pytest.mark.parametrize("make", [lambda: tiny("llama"), lambda: tiny("qwen2"), odd_llama],
                         ids=["tiny-gqa-llama", "tiny-qwen2-biases", "odd-shapes"])
def test_quantized_products_give_the_lean_step_over_the_dequantized_weights(name, flags,
                                                                            make):
    """Logits within float32 rounding of the lean forward over the dequantized weights
    (the sums run per block, then times the scale), the same tokens and cache; the float
    model's logits are far outside that bound, so the codes were read right."""
    library = quantized_build(name, flags)
    model = make()
    lean, reference = LeanLlama.from_model(model), LeanLlama.from_model(dequantized(model, name))
    for threads in (1, 2):
        step = kernel.NativeStep(lean, threads, library, weights=name)
        assert_native_follows_lean(reference, step, [1, 5, 9, 200], kv_atol=3e-5)
    cache, exact = lean.new_cache(8), lean.new_cache(8)
    lean.prefill(torch.tensor([[1, 5]]), cache)
    lean.prefill(torch.tensor([[1, 5]]), exact)
    off = (step(9, cache) - lean.step(torch.tensor([[9]]), exact)).abs().max()
    assert off > 1e-3, "the float32 model gives these logits: the matrices were not quantized"


@pytest.mark.parametrize("name", ["nf4", "q4_0"])
def test_4bit_keeps_the_output_matrix_in_q8_0_and_a_checkpoint_as_stored(name):
    """Packed from float weights, a 4-bit kernel's output matrix is q8_0 (llama.cpp's
    Q4_0 files keep it at 6 or 8 bits), in q8_0's bytes (a checkpoint's: in
    test_quantized_checkpoint.py)."""
    from types import SimpleNamespace

    lean = LeanLlama.from_model(tiny("llama"))
    step = kernel.NativeStep(lean, 1, quantized_build(name), weights=name)
    assert step.head_weights == "q8_0"
    vocab, hidden = lean.embed.shape
    panel = quantized_build(name).genlab_panel_rows()
    head = kernel.packed_weights(lean, panel, name)["lm_head"]
    assert head.numel() == quant.packed_bytes(vocab, hidden, panel, "q8_0")
    assert kernel.head_format(SimpleNamespace(stored=None), name) == "q8_0"
    assert kernel.head_format(SimpleNamespace(stored=None), "q8_0") == "q8_0"
    assert kernel.head_format(SimpleNamespace(stored=None), "float32") == "float32"


def test_a_build_for_another_format_is_refused():
    lean = LeanLlama.from_model(tiny("llama"))
    with pytest.raises(ValueError, match="does not read nf4 matrices"):
        kernel.NativeStep(lean, 1, quantized_build("q8_0"), weights="nf4")


def greedy_lean(lean: LeanLlama, ids: list[int], steps: int) -> list[int]:
    cache = lean.new_cache(len(ids) + steps)
    logits = lean.prefill(torch.tensor([ids]), cache)
    out = []
    for _ in range(steps):
        token = int(logits.argmax())
        out.append(token)
        logits = lean.step(torch.tensor([[token]]), cache)
    return out


def greedy_native(step: kernel.NativeStep, lean: LeanLlama, ids: list[int], steps: int
                  ) -> list[int]:
    cache = lean.new_cache(len(ids) + steps)
    logits = step.extend(ids, cache, all_logits=False)
    out = []
    for _ in range(steps):
        token = int(logits.argmax())
        out.append(token)
        logits = step(token, cache)
        cache.length += 1
    return out


@pytest.mark.parametrize("name", FORMATS)
def test_greedy_tokens_on_real_models_are_the_dequantized_forwards(name, stories, code_target):
    """stories260K and code-target, 48 greedy tokens: the tokens of the lean forward over
    the dequantized weights, and (4-bit) not all the float32 model's."""
    library = quantized_build(name)
    for lm, ids in ((stories, stories.encode("Once upon a time")),
                    (code_target, code_target.encode("import os\nimport sys\n\n\ndef main("))):
        model = lm.model
        lean = LeanLlama.from_model(model)
        step = kernel.NativeStep(lean, 2, library, weights=name)
        want = greedy_lean(LeanLlama.from_model(dequantized(model, name)), ids, 48)
        assert greedy_native(step, lean, ids, 48) == want


# --- where --quantize runs, and every mode on quantized weights -----------------------------

@pytest.fixture(scope="module")
def stories_q8():
    from genlib.models.loading import ModelSpec, load_model
    from tests.conftest import STORIES

    if not STORIES.is_dir():
        pytest.skip("stories260K is not present")
    quantized_build("q8_0")
    return load_model(ModelSpec(str(STORIES), quantize="8bit"), quick=True)


def test_8bit_on_a_cpu_runs_q8_0_on_the_native_backend(stories_q8):
    from genlib.backends.choose import Request, choose_backend

    assert (stories_q8.quantize, stories_q8.weights, stories_q8.dtype_name) == (
        "8bit", "q8_0", "float32")
    backend = choose_backend(stories_q8, Request(rows=3, reorder=True))
    assert backend.name == "native" and backend.weights == "q8_0"
    assert backend.reason == "--quantize 8bit: weights q8_0"
    asked = choose_backend(stories_q8, Request(backend="native"))
    assert asked.reason == "asked for with --backend, weights q8_0"


def test_4bit_names_its_output_matrix_where_it_ran():
    """--stats and --json name the formats that ran: 4-bit weights, the output matrix
    in q8_0."""
    from genlib.backends.choose import Request, choose_backend
    from genlib.models.info import ModelSpec
    from genlib.models.loading import load_model
    from tests.conftest import STORIES

    quantized_build("nf4")
    lm = load_model(ModelSpec(str(STORIES), quantize="4bit"), quick=True)
    assert choose_backend(lm, Request(rows=1)).reason == \
        "--quantize 4bit: weights nf4, output matrix q8_0"
    assert choose_backend(lm, Request(backend="native")).reason == \
        "asked for with --backend, weights nf4, output matrix q8_0"


@pytest.mark.parametrize("backend", ["lean", "compiled", "transformers"])
def test_other_backends_refuse_the_kernels_quantized_weights(stories_q8, backend):
    from genlib.backends.choose import Request, choose_backend
    from genlib.errors import ConfigError

    with pytest.raises(ConfigError, match=f"the {backend} backend does not read the native "
                                          f"kernel's q8_0 weights .*use --backend native"):
        choose_backend(stories_q8, Request(backend=backend))


def test_where_the_native_kernel_quantizes_and_where_bitsandbytes_does():
    from genlib.backends.choose import native_quantization
    from genlib.errors import ConfigError

    assert native_quantization("4bit", "cpu", "auto", "auto", True) == "nf4"
    assert native_quantization("q4_0", "cpu", "float32", "native", True) == "q4_0"
    assert native_quantization("none", "cpu", "auto", "auto", True) is None
    for device, dtype, backend, llama in (("cuda", "auto", "auto", True),
                                          ("cpu", "auto", "transformers", True),
                                          ("cpu", "auto", "auto", False),
                                          ("cpu", "bfloat16", "auto", True)):
        assert native_quantization("8bit", device, dtype, backend, llama) is None
    with pytest.raises(ConfigError, match=r"--quantize 8bit on the native backend quantizes "
                                          r"plain Llama-style models .*; use --quantize 8bit or "
                                          r"4bit with --backend transformers \(bitsandbytes\)"):
        native_quantization("8bit", "cpu", "auto", "native", False)
    with pytest.raises(ConfigError, match="--quantize nf4 on the native backend quantizes a "
                                          "float32 Llama-style model on the CPU"):
        native_quantization("nf4", "cuda", "auto", "auto", True)


PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went"]


def test_a_quantized_batch_gives_each_row_its_tokens_alone(stories_q8):
    from genlib.generate import generate, stream
    from genlib.settings.config import GenerationSettings

    settings = GenerationSettings(max_new_tokens=40)
    rows = [stories_q8.encode(p) for p in PROMPTS]
    alone = [generate(stories_q8, [ids], settings)[0].token_ids for ids in rows]
    events = list(stream(stories_q8, rows, settings))
    assert (events[0].backend, events[0].backend_reason) == ("native",
                                                             "--quantize 8bit: weights q8_0")
    together = sorted((e for e in events if type(e).__name__ == "Finish"),
                      key=lambda f: f.row)
    assert [f.token_ids for f in together] == alone


def test_one_beam_on_quantized_weights_is_their_greedy_search(stories_q8):
    from genlib.decoding.beam import beam_search
    from genlib.generate import generate
    from genlib.settings.config import GenerationSettings

    ids = stories_q8.encode(PROMPTS[0])
    greedy = generate(stories_q8, [ids], GenerationSettings(max_new_tokens=40))[0]
    settings = GenerationSettings(strategy="beam", num_beams=1, max_new_tokens=40)
    hyp = beam_search(stories_q8, [ids], settings)[0].hypotheses[0]
    assert hyp.token_ids == greedy.token_ids
    wide = GenerationSettings(strategy="beam", num_beams=3, max_new_tokens=20)
    assert beam_search(stories_q8, [ids], wide)[0].hypotheses[0].token_ids


def test_a_quantized_draft_of_the_quantized_target_accepts_every_token(stories_q8):
    from genlib.decoding.speculative import speculative_stream
    from genlib.events import Finish, Verify
    from genlib.generate import generate
    from genlib.settings.config import resolve_settings

    settings = resolve_settings({"max_new_tokens": 40})
    ids = stories_q8.encode(PROMPTS[1])
    plain = generate(stories_q8, [ids], settings)[0]
    events = list(speculative_stream(stories_q8, ids, settings, draft_lm=stories_q8,
                                     num_draft_tokens=4))
    finish = next(e for e in events if isinstance(e, Finish))
    assert finish.token_ids == plain.token_ids
    verifies = [e for e in events if isinstance(e, Verify)]
    assert verifies and all(v.accepted == v.proposed for v in verifies)
    assert events[0].draft_weights == "q8_0"


def test_fidelity_compares_each_format_with_float32_position_by_position():
    """Perplexity from the lean forward's own log-softmax, windows from empty caches;
    float32 agrees with itself; a format's KL is positive and its agreement below 1 on
    a random model's flat distributions."""
    from genlib.lab.fidelity import fidelity

    lean = LeanLlama.from_model(tiny("llama"))
    torch.manual_seed(5)
    tokens = torch.randint(3, 500, (21,)).tolist()
    report = fidelity(lean, tokens, ["q4_0"], window=8, threads=1)
    nll = 0.0
    for start in range(0, 21, 8):  # windows 8, 8, 5: 7 + 7 + 4 predictions
        piece = tokens[start:start + 8]
        cache = lean.new_cache(8)
        logits = torch.stack([lean.step(torch.tensor([[t]]), cache)[0] for t in piece[:-1]])
        logprobs = torch.log_softmax(logits.double(), -1)
        nll -= float(logprobs[torch.arange(len(piece) - 1), piece[1:]].sum())
    exact = report["float32"]
    assert exact.positions == 18 and (exact.top1_agreement, exact.mean_kl) == (1.0, 0.0)
    assert exact.perplexity == pytest.approx(float(np.exp(nll / 18)), rel=1e-4)
    four = report["q4_0"]
    assert four.mean_kl > 1e-4 and four.perplexity != pytest.approx(exact.perplexity, rel=1e-4)
    assert exact.perplexity_error == 0.0 and four.perplexity_error > 0
    one_window = fidelity(lean, tokens, ["q4_0"], window=32, threads=1)
    assert one_window["q4_0"].perplexity_error is None  # no spread from a single window


def test_a_paired_difference_takes_the_windows_as_its_units():
    """The mean NLL gap a position is the log of the perplexities' ratio; its standard
    error is the ratio estimator's over windows, computed here by hand from the windows'
    sums (window 1: 3 positions, 2: 2, 3: 1)."""
    from genlib.lab.fidelity import Tally

    a, b = Tally(), Tally()
    uniform = torch.log_softmax(torch.zeros(3, 4, dtype=torch.float64), -1)
    sharp = torch.log_softmax(torch.tensor([[2.0, 0, 0, 0]] * 3, dtype=torch.float64), -1)
    for target in ([0, 1, 2], [0, 0], [3]):
        n, t = len(target), torch.tensor(target)
        a.add(uniform[:n], sharp[:n], t)
        b.add(uniform[:n], uniform[:n], t)
    assert b.difference(b) == (0.0, 0.0)
    gaps = [a.window_nll[i] - b.window_nll[i] for i in range(3)]
    sizes = [3, 2, 1]
    mean = sum(gaps) / 6
    assert np.exp(mean) == pytest.approx(a.figures("a").perplexity / b.figures("b").perplexity)
    se = (sum((g - mean * n) ** 2 for g, n in zip(gaps, sizes)) * 3 / 2) ** 0.5 / 6
    assert a.difference(b) == pytest.approx((mean, se))
    assert se > 0 and b.difference(a) == pytest.approx((-mean, se))
    with pytest.raises(ValueError, match="same two or more windows"):
        a.difference(Tally())


def test_a_model_with_a_nan_weight_is_one_line_under_quantize(tmp_path):
    """Packing a damaged matrix into a quantized format fails at load, in one line that
    names the matrix; the float model still runs (its NaN is the user's to find)."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from cli.main import app
    from tests.conftest import STORIES

    folder = tmp_path / "model"
    folder.mkdir()
    for item in STORIES.iterdir():
        if item.name != "model.safetensors":
            (folder / item.name).symlink_to(item)
    tensors = load_file(STORIES / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    done = CliRunner().invoke(app, ["generate", "x", "-m", str(folder), "--quantize", "4bit",
                                    "-n", "2"])
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output
    assert done.output.strip().splitlines()[-1] == (
        "error: model.layers.1.mlp.up_proj.weight: it holds NaN or infinite weights, which "
        "nf4 cannot quantize; the model's weights are damaged, or run it without --quantize")


def test_the_checkpoint_tool_names_a_matrix_it_cannot_quantize():
    from genlib.models.qwrite import QuantizeError, _matrix

    w = torch.randn(8, 64)
    w[1, 1] = float("-inf")
    with pytest.raises(QuantizeError, match=r"^lm_head.weight: it holds NaN or infinite "
                                            r"weights, which q8_0 cannot quantize; the "
                                            r"source model's weights are damaged$"):
        _matrix("lm_head.weight", w, "q8_0")
