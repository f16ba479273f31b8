"""The native decode step (genlib/backends/kernel.py, genlib/backends/csrc/lean_step.c)
against the lean forward it replaces in the native backend: the same logits to float32
rounding, the same cache contents, the same greedy tokens as transformers' generate();
its build, and which backend auto picks where it cannot run."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch

from genlib import generate
from genlib.backends import compiled, kernel
from genlib.backends.choose import Request, choose_backend
from genlib.backends.compiled import is_small, lean_compiled_step
from genlib.backends.lean import LeanBackend, lean_model_of
from genlib.backends.llama import LeanLlama
from genlib.backends.native import NativeBackend, native_step
from genlib.errors import ConfigError
from genlib.models.loading import wrap_model
from tests.conftest import tiny_config, torch_threads
from tests.test_lean import genlab_greedy, greedy


def odd_llama():
    """Shapes that exercise every remainder: 6 heads over 3 KV heads, head_dim 8, an
    intermediate size (72) and rows per thread that are not multiples of 16 or 4."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=509, hidden_size=48, intermediate_size=72,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                         max_position_embeddings=128, initializer_range=0.3,
                         bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(config).eval()


def tiny(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch)).eval()


def assert_native_follows_lean(lean: LeanLlama, step: kernel.NativeStep, ids: list[int],
                               steps: int = 40, kv_atol: float = 1e-5) -> None:
    """`steps` tokens (past 16 positions, so every vector remainder runs) through the
    native step and the lean step side by side: logits within float32 rounding of the
    sums' order, the same greedy token, the same KV cache."""
    eager, fast = lean.new_cache(len(ids) + steps), lean.new_cache(len(ids) + steps)
    logits = lean.prefill(torch.tensor([ids]), eager)
    lean.prefill(torch.tensor([ids]), fast)
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        logits = lean.step(token, eager)
        got = step(int(token), fast)
        fast.length += 1
        torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-4)
        assert int(got.argmax()) == int(logits.argmax())
    for expected, actual in zip(eager.keys + eager.values, fast.keys + fast.values):
        torch.testing.assert_close(actual[:, :, :eager.length], expected[:, :, :eager.length],
                                   rtol=1e-5, atol=kv_atol)


TINY = [lambda: tiny("llama"), lambda: tiny("qwen2"), odd_llama]
TINY_IDS = ["tiny-gqa-llama", "tiny-qwen2-biases", "odd-shapes"]
# The kernel's vector paths, by the build flags that select them on this CPU
PORTABLE = {"native": (), "no AVX-512": ("-mno-avx512f",),
            "no AVX2 (generic vectors, libm's expf)": ("-mno-avx512f", "-mno-avx2")}


@pytest.mark.parametrize("make", TINY, ids=TINY_IDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_step_follows_the_lean_step_on_tiny_models(library, make, threads):
    lean = LeanLlama.from_model(make())
    assert_native_follows_lean(lean, kernel.NativeStep(lean, threads, library), [1, 5, 9, 200])


@pytest.mark.slow
def test_native_step_follows_the_lean_step_on_real_models(library, stories, code_target):
    for lm, ids in ((stories, stories.encode("Once upon a time")),
                    (code_target, code_target.encode("def fibonacci(n):\n    "))):
        lean = lean_model_of(lm)
        for threads in (1, 2):
            assert_native_follows_lean(lean, kernel.NativeStep(lean, threads, library), ids)


def test_the_portable_build_follows_the_lean_step_too(library):
    """Without AVX-512 the kernel takes its portable path (GCC's vector extensions)."""
    portable = kernel.build(kernel.FLAGS + ("-mno-avx512f",))
    if portable.library is None:
        pytest.skip(f"no portable build here: {portable.reason}")
    for make in (lambda: tiny("llama"), odd_llama):
        lean = LeanLlama.from_model(make())
        for threads in (1, 2):
            step = kernel.NativeStep(lean, threads, portable.library)
            assert_native_follows_lean(lean, step, [1, 5, 9, 200])


def bf16_matrices(model):
    """A copy of `model` whose projections and lm_head hold bfloat16 values (in float32,
    the lm_head untied from the embeddings, which stay as they were): what a native step
    with bfloat16 matrices computes, in the lean forward's float32 arithmetic."""
    import copy

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        rounded.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
        for module in rounded.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
    return rounded


@pytest.mark.parametrize("make", TINY, ids=TINY_IDS)
@pytest.mark.parametrize("flags", [PORTABLE["native"], PORTABLE["no AVX-512"]],
                         ids=["native", "no AVX-512"])
def test_bfloat16_matrices_give_the_lean_step_over_bfloat16_weights(library, make, flags):
    """A step that stores its matrices in bfloat16 (a draft model's) computes what the
    lean forward computes over those rounded matrices, in float32: the same logits to
    float32 rounding, tokens and cache. The float32 model's logits are farther off than
    that tolerance, so the check sees whether the bfloat16 values were read right. (The
    odd shapes' large weights put one cached value 1.3e-5 off in a run, a float32
    rounding of its sums' order: the caches are checked to 3e-5.)"""
    build = kernel.build(kernel.FLAGS + flags + kernel.WEIGHTS["bfloat16"])
    if build.library is None:
        pytest.skip(f"no bfloat16 build here: {build.reason}")
    model = make()
    lean, reference = LeanLlama.from_model(model), LeanLlama.from_model(bf16_matrices(model))
    for threads in (1, 2):
        step = kernel.NativeStep(lean, threads, build.library, weights="bfloat16")
        assert_native_follows_lean(reference, step, [1, 5, 9, 200], kv_atol=3e-5)
    cache, exact = lean.new_cache(8), lean.new_cache(8)
    lean.prefill(torch.tensor([[1, 5]]), cache)
    lean.prefill(torch.tensor([[1, 5]]), exact)
    off = (step(9, cache) - lean.step(torch.tensor([[9]]), exact)).abs().max()
    assert off > 1e-3, "the float32 model gives these logits: the matrices were not rounded"


def test_a_build_that_reads_other_matrices_is_refused(library):
    lean = LeanLlama.from_model(tiny("llama"))
    with pytest.raises(ValueError, match="does not read bfloat16 matrices"):
        kernel.NativeStep(lean, 1, library, weights="bfloat16")
    bfloat16 = kernel.build_for("bfloat16").library
    if bfloat16 is None:
        pytest.skip(kernel.build_for("bfloat16").reason)
    with pytest.raises(ValueError, match="does not read float32 matrices"):
        kernel.NativeStep(lean, 1, bfloat16, weights="float32")
    with pytest.raises(ValueError, match="as float32, bfloat16, q8_0, nf4, q4_0, not float16"):
        kernel.NativeStep(lean, 1, bfloat16, weights="float16")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "auto"])
def test_the_native_backend_runs_the_kernel_with_generates_tokens(library, stories,
                                                                  code_target, monkeypatch,
                                                                  backend):
    """The native backend (auto's pick) on float32 Llama models runs the native kernel,
    token for token as transformers' generate() (the lean tests check genlab_greedy
    against it)."""
    calls = []
    real = kernel.NativeStep.__call__
    monkeypatch.setattr(kernel.NativeStep, "__call__",
                        lambda self, *args: calls.append(1) or real(self, *args))
    for lm, prompt, n in ((stories, "Once upon a time", 120),
                          (code_target, "def fibonacci(n):\n    ", 64)):
        ids = lm.encode(prompt)
        expected = genlab_greedy(lm, ids, n)
        assert not calls  # the lean backend's steps are not the kernel's
        with torch_threads(2):
            events = list(generate.stream(lm, [ids], greedy(n), backend=backend))
        assert events[0].backend == "native"
        assert list(events[-1].token_ids) == expected
        assert len(calls) == n - 1  # every step after the prefill's token
        calls.clear()


def tiny_lm(stories_tokenizer, arch: str = "llama"):
    return wrap_model(tiny(arch), stories_tokenizer, ref=f"tiny-{arch}")


def test_the_kernel_runs_on_torchs_threads_however_small_the_model(library,
                                                                 stories_tokenizer):
    """A model far below the compiled step's one-thread size still gets every thread:
    the kernel has one parallel region a step, and two threads were faster on every
    model measured (docs/performance.md)."""
    for threads in (1, 2):
        with torch_threads(threads):
            lean = lean_model_of(tiny_lm(stories_tokenizer))
            assert is_small(lean)
            assert native_step(lean).threads == threads


def test_auto_picks_native_and_genlab_native_0_picks_lean(library, stories_tokenizer,
                                                           monkeypatch):
    lm = tiny_lm(stories_tokenizer)
    backend = choose_backend(lm, Request())
    assert isinstance(backend, NativeBackend) and backend.kernel is native_step(lean_model_of(lm))
    assert backend.reason == "a float32 llama model on the CPU"
    for rows, reorder in ((2, False), (1, True)):  # batches and beams run on it too
        several = choose_backend(lm, Request(rows=rows, reorder=reorder))
        assert several.name == "native" and several.reason == backend.reason
    monkeypatch.setenv("GENLAB_NATIVE", "0")
    backend = choose_backend(lm, Request())
    assert type(backend) is LeanBackend and backend.reason == \
        "the lean forward; GENLAB_NATIVE=0 keeps auto off the native kernel"
    # The switch keeps auto off the kernel; asked for by name it still runs.
    assert isinstance(choose_backend(lm, Request(backend="native")), NativeBackend)
    ids = [1, 5, 9, 200]
    events = list(generate.stream(lm, [ids], greedy(20)))
    assert (events[0].backend, events[0].backend_reason) == \
        ("lean", "the lean forward; GENLAB_NATIVE=0 keeps auto off the native kernel")
    assert list(events[-1].token_ids) == genlab_greedy(lm, ids, 20, backend="native")


def test_the_compiled_step_is_torch_compile_where_the_kernel_applies(library):
    lean = LeanLlama.from_model(tiny("llama"))
    assert isinstance(native_step(lean), kernel.NativeStep)
    eager, cache = lean.new_cache(8), lean.new_cache(8)
    logits = lean.prefill(torch.tensor([[1, 2]]), cache)
    lean.prefill(torch.tensor([[1, 2]]), eager)
    token = logits.argmax(-1, keepdim=True)
    torch.testing.assert_close(lean_compiled_step(lean, token, cache), lean.step(token, eager),
                               rtol=1e-5, atol=1e-4)
    assert lean in compiled._lean_steps and cache.native is None  # the kernel never ran


def test_without_a_compiler_auto_picks_lean_and_native_is_refused(monkeypatch, tmp_path,
                                                                 stories_tokenizer):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kernel.build.cache_clear()
    try:
        lean = LeanLlama.from_model(tiny("llama"))
        assert "could not build lean_step.c" in kernel.applies(lean)
        assert native_step(lean) is None
        lm = tiny_lm(stories_tokenizer)
        backend = choose_backend(lm, Request())
        assert type(backend) is LeanBackend
        assert backend.reason.startswith("the lean forward; the native backend cannot run "
                                         "here: could not build lean_step.c")
        with pytest.raises(ConfigError, match="the native backend cannot run here: could "
                                              "not build lean_step.c.*--backend lean"):
            choose_backend(lm, Request(backend="native"))
    finally:
        kernel.build.cache_clear()


def test_a_compiler_error_is_reported_as_the_reason(monkeypatch, tmp_path):
    kernel.build.cache_clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        build = kernel.build(kernel.FLAGS + ("-fno-such-flag",))
        assert build.library is None
        assert "failed" in build.reason and "no-such-flag" in build.reason
    finally:
        kernel.build.cache_clear()


def test_the_library_is_built_once_and_then_read_from_the_cache(library, monkeypatch,
                                                                 tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel.build.cache_clear()
    try:
        assert kernel.build().library is not None
        built = list((tmp_path / "genlab" / "native").glob("lean_step-*.so"))
        assert len(built) == 1
        kernel.build.cache_clear()

        def no_compiling(*args):
            raise AssertionError("compiled again")

        monkeypatch.setattr(kernel, "_compile", no_compiling)
        assert kernel.build().library is not None
    finally:
        kernel.build.cache_clear()


def test_a_token_outside_the_embeddings_is_refused(library):
    lean = LeanLlama.from_model(tiny("llama"))
    cache = lean.new_cache(8)
    lean.prefill(torch.tensor([[1, 2]]), cache)
    with pytest.raises(ValueError, match="outside the model's 512 embeddings"):
        kernel.NativeStep(lean, 1, library)(512, cache)


def test_a_full_cache_is_refused_before_the_kernel_writes_past_it(library):
    lean = LeanLlama.from_model(tiny("llama"))
    cache = lean.new_cache(3)
    lean.prefill(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="4 tokens exceed the KV buffers' 3"):
        kernel.NativeStep(lean, 1, library)(5, cache)


def test_a_cache_gets_scratch_for_the_step_that_runs_it(library):
    """Scratch is sized by the step's threads: a cache first run by a one-thread step
    gets new scratch from a two-thread one, and both follow the lean step."""
    lean = LeanLlama.from_model(odd_llama())
    one, two = kernel.NativeStep(lean, 1, library), kernel.NativeStep(lean, 2, library)
    eager, cache = lean.new_cache(16), lean.new_cache(16)
    ids = torch.tensor([[1, 5, 9]])
    logits = lean.prefill(ids, eager)
    lean.prefill(ids, cache)
    for step in (one, two, one):
        token = logits.argmax(-1, keepdim=True)
        logits = lean.step(token, eager)
        torch.testing.assert_close(step(int(token), cache), logits, rtol=1e-5, atol=1e-4)
        cache.length += 1
        assert cache.native.step is step


# --- Many tokens in one call: extend (one row's k tokens) and step_rows (B rows) -------


@pytest.fixture(scope="module", params=list(PORTABLE), ids=list(PORTABLE))
def any_library(request, library):
    """The kernel as this CPU builds it, and its portable paths: the same checks hold for
    each (they compute the same sums in another order)."""
    build = kernel.build(kernel.FLAGS + PORTABLE[request.param])
    if build.library is None:
        pytest.skip(f"no {request.param} build here: {build.reason}")
    return build.library


IDS = [1, 5, 9, 200, 7, 3, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71]


def native_steps(step: kernel.NativeStep, tokens: list[int], cache) -> torch.Tensor:
    """The one-token path, token by token: the reference for the many-token calls."""
    rows = []
    for token in tokens:
        rows.append(step(token, cache))
        cache.length += 1
    return torch.cat(rows)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, unwritten slots included: a cache's buffers start uninitialized, and
    garbage that reads as NaN is not equal to itself as a float."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_same_kv(a, b, length: int) -> None:
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert torch.equal(x[:, :, :length], y[:, :, :length])


@pytest.mark.parametrize("make", TINY, ids=TINY_IDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_extend_gives_the_bits_of_one_token_steps(any_library, make, threads):
    """k tokens after a cached prefix in one call: every row of logits and every KV slot
    bit for bit those of k one-token calls (each (weight row, token) sum runs in the same
    order), and within float32 rounding of the lean forward's extend, same argmax."""
    lean = LeanLlama.from_model(make())
    step = kernel.NativeStep(lean, threads, any_library)
    for prefix, k in ((3, 1), (4, 6), (17, 5)):  # past 16 positions: every remainder
        steps, extended, eager = (lean.new_cache(32) for _ in range(3))
        native_steps(step, IDS[:prefix], steps)
        expected = native_steps(step, IDS[prefix:prefix + k], steps)
        step.extend(IDS[:prefix], extended)
        got = step.extend(IDS[prefix:prefix + k], extended)
        assert got.shape == (k, lean.lm_head.w.shape[1])
        assert torch.equal(got, expected)
        assert extended.length == steps.length == prefix + k
        assert_same_kv(extended, steps, prefix + k)
        lean.prefill(torch.tensor([IDS[:prefix]]), eager)
        lean_logits = lean.extend(torch.tensor([IDS[prefix:prefix + k]]), eager)[0]
        torch.testing.assert_close(got, lean_logits, rtol=1e-5, atol=1e-4)
        assert torch.equal(got.argmax(-1), lean_logits.argmax(-1))


def test_every_count_of_tokens_in_a_call_gives_the_bits_of_one_token_steps(any_library):
    """The products take the slots a tile at a time (6 or 12 of them, by CPU) and the
    rest in a pass of its own: 1 to 25 tokens in one call, every whole-tile count and
    every remainder, give the bits of one-token calls."""
    lean = LeanLlama.from_model(tiny("llama"))
    step = kernel.NativeStep(lean, 2, any_library)
    tokens = (IDS * 2)[:25]
    reference = lean.new_cache(32)
    expected = native_steps(step, tokens, reference)
    for k in range(1, len(tokens) + 1):
        cache = lean.new_cache(32)
        assert torch.equal(step.extend(tokens[:k], cache), expected[:k]), f"{k} tokens"
        assert_same_kv(cache, reference, k)


@pytest.mark.parametrize("make", TINY, ids=TINY_IDS)
def test_the_thread_count_does_not_change_the_bits(any_library, make):
    """Each (weight row, token) sum runs over one panel column after another, whichever
    thread owns the panel: one thread and two give the same logits and KV slots."""
    lean = LeanLlama.from_model(make())
    one, two = (kernel.NativeStep(lean, threads, any_library) for threads in (1, 2))
    caches = [lean.new_cache(32) for _ in range(2)]
    got = [step.extend(IDS[:9], cache) for step, cache in zip((one, two), caches)]
    assert torch.equal(got[0], got[1])
    assert_same_kv(caches[0], caches[1], 9)


@pytest.mark.parametrize("make", TINY, ids=TINY_IDS)
@pytest.mark.parametrize("cut", [256, 5])
def test_prefill_rows_gives_each_rows_bits(any_library, make, cut, monkeypatch):
    """Prompts of several rows in calls of at most `cut` tokens (5: calls that end inside
    a row): each row's last logits and KV slots are the bits of its own one-token calls,
    whatever its batch-mates."""
    monkeypatch.setattr(kernel, "PREFILL_SLOTS", cut)
    lean = LeanLlama.from_model(make())
    step = kernel.NativeStep(lean, 2, any_library)
    rows = [IDS[:7], IDS[3:4], IDS[:13], IDS[5:16]]
    caches = [lean.new_cache(32) for _ in rows]
    got = step.prefill_rows(rows, caches)
    assert got.shape == (len(rows), lean.lm_head.w.shape[1])
    for row, cache, logits in zip(rows, caches, got):
        alone = lean.new_cache(32)
        expected = native_steps(step, row, alone)[-1]
        assert torch.equal(logits, expected)
        assert cache.length == len(row)
        assert_same_kv(cache, alone, len(row))


def test_prefill_rows_refuses_an_empty_row_and_a_shared_cache(library):
    lean = LeanLlama.from_model(tiny("llama"))
    step = kernel.NativeStep(lean, 1, library)
    cache = lean.new_cache(8)
    with pytest.raises(ValueError, match="at least one token"):
        step.prefill_rows([[1, 2], []], [cache, lean.new_cache(8)])
    with pytest.raises(ValueError, match="each cache once"):
        step.prefill_rows([[1], [2]], [cache, cache])
    assert cache.length == 0


@pytest.mark.parametrize("make", TINY, ids=TINY_IDS)
def test_chunked_prefill_through_extend_matches_the_lean_prefill(any_library, make):
    """A prompt from position 0, whole or in chunks, last logits only: lean.prefill's
    logits and KV to float32 rounding; the chunks give the whole's bits."""
    lean = LeanLlama.from_model(make())
    step = kernel.NativeStep(lean, 2, any_library)
    eager, whole, chunked = (lean.new_cache(32) for _ in range(3))
    expected = lean.prefill(torch.tensor([IDS]), eager)
    got = step.extend(IDS, whole, all_logits=False)
    assert got.shape == (1, lean.lm_head.w.shape[1])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    assert int(got.argmax()) == int(expected.argmax())
    for start, end in ((0, 5), (5, 8), (8, len(IDS))):
        last = step.extend(IDS[start:end], chunked, all_logits=False)
    assert torch.equal(last, got)
    assert whole.length == chunked.length == eager.length == len(IDS)
    assert_same_kv(chunked, whole, len(IDS))
    for x, y in zip(whole.keys + whole.values, eager.keys + eager.values):
        torch.testing.assert_close(x[:, :, :len(IDS)], y[:, :, :len(IDS)], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("make", TINY, ids=TINY_IDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_step_rows_gives_each_rows_bits(any_library, make, threads):
    """B rows of different lengths, one token each per call: row b's logits and KV bit
    for bit a one-token call on its own cache; a row that finishes drops out of the
    next call and the others go on unchanged."""
    lean = LeanLlama.from_model(make())
    step = kernel.NativeStep(lean, threads, any_library)
    lengths = [1, 4, 17, 9, 2]
    batch = [lean.new_cache(32) for _ in lengths]
    alone = [lean.new_cache(32) for _ in lengths]
    for length, rows, row in zip(lengths, batch, alone):
        step.extend(IDS[:length], rows)
        native_steps(step, IDS[:length], row)
    live = list(range(len(lengths)))
    for call in range(4):
        tokens = [IDS[(3 * b + call) % len(IDS)] for b in live]
        got = step.step_rows(tokens, [batch[b] for b in live])
        assert got.shape == (len(live), lean.lm_head.w.shape[1])
        for row, (b, token) in enumerate(zip(live, tokens)):
            assert torch.equal(got[row:row + 1], native_steps(step, [token], alone[b]))
            assert batch[b].length == alone[b].length
            assert_same_kv(batch[b], alone[b], alone[b].length)
        live = live[:-1] if call % 2 == 0 else live[1:]  # a row at either end finishes


@pytest.mark.slow
def test_extend_and_step_rows_on_real_models(library, stories, code_target):
    """Six drafted tokens verified in one call on stories260K and code-target: the bits of
    six steps, the lean extend's tokens; two rows of different prompts stepped together:
    each row's bits."""
    for lm, prompt in ((stories, "Once upon a time"), (code_target, "def fibonacci(n):\n")):
        lean = lean_model_of(lm)
        ids = lm.encode(prompt)
        draft = [(7 * i + 11) % 500 for i in range(6)]
        for threads in (1, 2):
            step = kernel.NativeStep(lean, threads, library)
            steps, extended, eager = (lean.new_cache(64) for _ in range(3))
            step.extend(ids, extended, all_logits=False)
            native_steps(step, ids, steps)
            lean.prefill(torch.tensor([ids]), eager)
            got = step.extend(draft, extended)
            assert torch.equal(got, native_steps(step, draft, steps))
            lean_logits = lean.extend(torch.tensor([draft]), eager)[0]
            torch.testing.assert_close(got, lean_logits, rtol=1e-5, atol=1e-4)
            assert torch.equal(got.argmax(-1), lean_logits.argmax(-1))
            other = lean.new_cache(64)
            step.extend(ids[:2], other)
            pair = step.step_rows([5, 6], [extended, other])
            assert torch.equal(pair[:1], native_steps(step, [5], steps))
            alone = lean.new_cache(64)
            native_steps(step, ids[:2], alone)
            assert torch.equal(pair[1:], native_steps(step, [6], alone))


def test_an_extend_past_the_cache_is_refused_before_the_kernel_writes(library):
    lean = LeanLlama.from_model(tiny("llama"))
    step = kernel.NativeStep(lean, 1, library)
    cache = lean.new_cache(6)
    step.extend([1, 2, 3], cache)
    before = [t.clone() for t in cache.keys + cache.values]
    with pytest.raises(ValueError, match="7 tokens exceed the KV buffers' 6"):
        step.extend([4, 5, 6, 7], cache)
    assert cache.length == 3
    assert all(same_bits(a, b) for a, b in zip(before, cache.keys + cache.values))
    with pytest.raises(ValueError, match="outside the model's 512 embeddings"):
        step.extend([4, 512], cache)
    with pytest.raises(ValueError, match="at least one token"):
        step.extend([], cache)
    assert cache.length == 3


def test_step_rows_refuses_a_full_cache_before_any_row_is_written(library):
    lean = LeanLlama.from_model(tiny("llama"))
    step = kernel.NativeStep(lean, 1, library)
    roomy, full = lean.new_cache(8), lean.new_cache(3)
    step.extend([1, 2], roomy)
    step.extend([1, 2, 3], full)
    before = [t.clone() for t in roomy.keys + roomy.values]
    with pytest.raises(ValueError, match="4 tokens exceed the KV buffers' 3"):
        step.step_rows([4, 5], [roomy, full])
    assert (roomy.length, full.length) == (2, 3)
    assert all(same_bits(a, b) for a, b in zip(before, roomy.keys + roomy.values))
    with pytest.raises(ValueError, match="each cache once"):
        step.step_rows([4, 5], [roomy, roomy])
    with pytest.raises(ValueError, match="one token per cache"):
        step.step_rows([4], [roomy, full])


# --- A greedy draft in one call ---------------------------------------------------------

def drafts_by_extend(step: kernel.NativeStep, feed: list[int], cache, gamma: int,
                     banned: tuple[int, ...] = (), banned_draws: int = 0
                     ) -> tuple[list[int], int]:
    """The reference for `draft_greedy`: what the drafter's Python loop does, one extend
    a token, torch's max, the banned ids set to -inf at the first `banned_draws` draws."""
    logits, forwards, drawn = step.extend(feed, cache)[-1], 1, []
    for i in range(gamma):
        row = logits.clone()
        if i < banned_draws:
            row[list(banned)] = -math.inf
        top, best = row.max(-1)
        if not float(top) > -math.inf:
            break
        drawn.append(int(best))
        if len(drawn) == gamma:
            break
        logits, forwards = step.extend([int(best)], cache)[-1], forwards + 1
    return drawn, forwards


@pytest.mark.parametrize("make", TINY, ids=TINY_IDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_greedy_draft_in_one_call_draws_what_extend_and_argmax_draw(any_library, make,
                                                                      threads):
    """Fed 1 or 4 tokens after a cached prefix, gamma 1 to 7: the same draws and forwards
    as extend and torch's argmax one token at a time, the cache as long and its KV slots
    the same bits (every fed token, the last draw not fed)."""
    lean = LeanLlama.from_model(make())
    step = kernel.NativeStep(lean, threads, any_library)
    for feed, gamma in (([IDS[3]], 1), ([IDS[3]], 6), (IDS[3:7], 7), (IDS[3:7], 2)):
        reference, drafted = lean.new_cache(32), lean.new_cache(32)
        step.extend(IDS[:3], reference)
        step.extend(IDS[:3], drafted)
        expected = drafts_by_extend(step, feed, reference, gamma)
        assert step.draft_greedy(feed, drafted, gamma) == expected
        assert len(expected[0]) == gamma and expected[1] == gamma
        assert drafted.length == reference.length == 3 + len(feed) + gamma - 1
        assert_same_kv(drafted, reference, drafted.length)


def test_a_greedy_draft_bans_ids_at_its_first_draws_only(library, code_target):
    """On code-target's real weights: banning the ids the unbanned draft draws first and
    second, at the first two draws, changes those draws (and so what follows) exactly as
    the reference loop does, and leaves the third draw free to take a banned id; every
    id banned: nothing drawn, the feed alone run."""
    lean = lean_model_of(code_target)
    step = kernel.NativeStep(lean, 2, library)
    ids = code_target.encode("def add(a, b):\n    return")

    def draft(gamma, banned=(), banned_draws=0, how=step.draft_greedy):
        cache = lean.new_cache(64)
        step.extend(ids[:-1], cache)
        return how(ids[-1:], cache, gamma, banned, banned_draws), cache.length

    free, _ = draft(6)
    banned = tuple(free[0][:2])
    (drawn, forwards), length = draft(6, banned, 2)
    assert (drawn, forwards) == draft(6, banned, 2, partial(drafts_by_extend, step))[0]
    assert drawn[0] not in banned and drawn[1] not in banned
    assert drawn != free[0]
    assert free[0][0] != free[0][1]
    (once, _), _ = draft(2, (free[0][1],), 1)  # banned at draw 1 alone: draw 2 takes it
    assert once == free[0][:2]
    everything = tuple(range(lean.embed.shape[0]))
    assert draft(6, everything, 1) == (([], 1), len(ids))


def test_a_greedy_draft_is_refused_before_the_kernel_writes(library):
    """Room for the feed and gamma - 1 draws, every fed id an embedding and every banned
    one an output id, checked before the call: the cache is left as it was."""
    lean = LeanLlama.from_model(tiny("llama"))
    step = kernel.NativeStep(lean, 1, library)
    cache = lean.new_cache(8)
    step.extend([1, 2, 3], cache)
    before = [t.clone() for t in cache.keys + cache.values]
    with pytest.raises(ValueError, match="9 tokens exceed the KV buffers' 8"):
        step.draft_greedy([4, 5], cache, 5)
    with pytest.raises(ValueError, match="banned id 512 is outside the model's 512 "
                                         "output ids"):
        step.draft_greedy([4], cache, 2, banned=(512,), banned_draws=1)
    with pytest.raises(ValueError, match="token 512 is outside the model's 512 embeddings"):
        step.draft_greedy([512], cache, 2)
    with pytest.raises(ValueError, match="at least one token and draws at least one"):
        step.draft_greedy([], cache, 2)
    assert cache.length == 3
    assert all(same_bits(a, b) for a, b in zip(before, cache.keys + cache.values))
    assert step.draft_greedy([4, 5], cache, 4)[1] == 4  # 3 + 2 + 3 fed: exactly full
    assert cache.length == 8
    step.vocab = step.tokens + 1  # an output id without an embedding: it cannot be fed
    with pytest.raises(ValueError, match="513 output ids exceed the model's 512 embeddings"):
        step.draft_greedy([4], lean.new_cache(8), 2)


def test_a_nan_logit_ends_a_greedy_draft_as_the_loops_max_does(library):
    """torch's max is NaN where any logit is: the drafter's loop ends its draft there, and
    so does the kernel's argmax, after the forward that gave it."""
    lean = LeanLlama.from_model(tiny("llama"))
    lean.lm_head.w[:, 300] = float("nan")
    step = kernel.NativeStep(lean, 1, library)
    drafted, reference = lean.new_cache(16), lean.new_cache(16)
    assert step.draft_greedy([1, 2], drafted, 4) == ([], 1)
    assert drafts_by_extend(step, [1, 2], reference, 4) == ([], 1)
    assert drafted.length == reference.length == 2


# --- The build: its notice, a missing compiler, a broken cache ------------------------

@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty build cache, and build()'s memo cleared before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel.build.cache_clear()
    yield tmp_path / "genlab" / "native"
    kernel.build.cache_clear()


def test_the_first_build_says_so_once(library, fresh_cache):
    said = []
    assert kernel.ensure_built(said.append).library is not None
    assert said == ["building genlab's native kernel for float32 weights (once per format "
                    "on this machine)"]
    kernel.build.cache_clear()
    assert kernel.ensure_built(said.append).library is not None
    assert len(said) == 1  # found in the cache: nothing to say


def test_cc_naming_a_missing_compiler_gives_the_reason(fresh_cache, monkeypatch):
    missing = fresh_cache / "no-such-cc"
    monkeypatch.setenv("CC", str(missing))
    said = []
    build = kernel.ensure_built(said.append)
    assert build.library is None
    assert build.reason.startswith(f"could not build lean_step.c: CC='{missing}' names no "
                                   f"program ('{missing}' is not found)")
    assert said == []  # nothing is built, so nothing is announced
    assert kernel.applies(LeanLlama.from_model(tiny("llama"))) == build.reason


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_broken_library_in_the_cache_is_rebuilt_not_loaded(library, fresh_cache,
                                                             monkeypatch, damage):
    """A cached file that is not what the build wrote (garbage; a good build cut short,
    its digest still there) is rebuilt rather than handed to dlopen, and the rebuilt
    kernel runs."""
    path = kernel._library_path(kernel._compiler(), kernel.FLAGS, kernel.SOURCE)
    path.parent.mkdir(parents=True)
    if damage == "garbage":
        path.write_bytes(b"\x7fELF not a library" * 100)
    else:  # half of the module's good build, with that build's digest
        whole = Path(library._name)
        data = whole.read_bytes()
        path.write_bytes(data[:len(data) // 2])
        kernel._digest_file(path).write_text(kernel._digest_file(whole).read_text())
    compiled = []
    real = kernel._compile
    monkeypatch.setattr(kernel, "_compile", lambda *args: compiled.append(1) or real(*args))
    build = kernel.build()
    assert build.library is not None and compiled == [1]
    assert kernel._intact(path)
    lean = LeanLlama.from_model(tiny("llama"))
    assert_native_follows_lean(lean, kernel.NativeStep(lean, 1, build.library), [1, 5],
                               steps=3)


def test_a_cloned_or_copied_cache_goes_on_as_the_original(library):
    """A beam's reorder: a clone, or another cache made to hold the same tokens, gives
    the original's next logits bit for bit, and writing one leaves the other alone."""
    lean = LeanLlama.from_model(odd_llama())
    step = kernel.NativeStep(lean, 2, library)
    original, other = lean.new_cache(32), lean.new_cache(32)
    step.extend(IDS[:9], original)
    step.extend(IDS[5:8], other)
    clone = original.clone()
    other.copy_from(original)
    assert clone.length == other.length == 9 and clone.native is None
    expected = step.step_rows([3, 4], [clone, other])
    assert torch.equal(step.extend([3], original), expected[:1])
    original.crop(9)
    assert torch.equal(step.extend([4], original), expected[1:])
    small = lean.new_cache(4)
    with pytest.raises(ValueError, match="10 tokens exceed the KV buffers' 4"):
        small.copy_from(original)
