"""The native decode step (genlib/native.py, genlib/csrc/lean_step.c) against the lean
forward it replaces under --compile: the same logits to float32 rounding, the same cache
contents, the same greedy tokens as transformers' generate(); its build and fallbacks."""

from __future__ import annotations

import pytest
import torch

from genlib import decode, forward, native
from genlib.lean import LeanLlama
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


def assert_native_follows_lean(lean: LeanLlama, step: native.NativeStep, ids: list[int],
                               steps: int = 40) -> None:
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
                                   rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def library():
    build = native.build()
    if build.library is None:
        pytest.skip(f"the native step cannot be built here: {build.reason}")
    return build.library


@pytest.mark.parametrize("make", [lambda: tiny("llama"), lambda: tiny("qwen2"), odd_llama],
                         ids=["tiny-gqa-llama", "tiny-qwen2-biases", "odd-shapes"])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_step_follows_the_lean_step_on_tiny_models(library, make, threads):
    lean = LeanLlama.from_model(make())
    assert_native_follows_lean(lean, native.NativeStep(lean, threads, library), [1, 5, 9, 200])


@pytest.mark.slow
def test_native_step_follows_the_lean_step_on_real_models(library, stories, code_target):
    for lm, ids in ((stories, stories.encode("Once upon a time")),
                    (code_target, code_target.encode("def fibonacci(n):\n    "))):
        lean = forward.lean_model(lm.model)
        for threads in (1, 2):
            assert_native_follows_lean(lean, native.NativeStep(lean, threads, library), ids)


def test_the_portable_build_follows_the_lean_step_too(library):
    """Without AVX-512 the kernel takes its portable path (GCC's vector extensions)."""
    portable = native.build(native.FLAGS + ("-mno-avx512f",))
    if portable.library is None:
        pytest.skip(f"no portable build here: {portable.reason}")
    for make in (lambda: tiny("llama"), odd_llama):
        lean = LeanLlama.from_model(make())
        for threads in (1, 2):
            step = native.NativeStep(lean, threads, portable.library)
            assert_native_follows_lean(lean, step, [1, 5, 9, 200])


@pytest.mark.slow
def test_compile_runs_the_native_step_with_generates_tokens(library, stories, code_target,
                                                            monkeypatch):
    """--compile on float32 Llama models runs the native kernel, token for token as
    transformers' generate() (the lean tests check genlab_greedy against it)."""
    calls = []
    real = native.NativeStep.__call__
    monkeypatch.setattr(native.NativeStep, "__call__",
                        lambda self, *args: calls.append(1) or real(self, *args))
    for lm, prompt, n in ((stories, "Once upon a time", 120),
                          (code_target, "def fibonacci(n):\n    ", 64)):
        ids = lm.encode(prompt)
        expected = genlab_greedy(lm, ids, n)
        with torch_threads(2):
            events = list(decode.stream(lm, [ids], greedy(n), compile=True))
        assert list(events[-1].token_ids) == expected
        assert len(calls) == n - 1  # every step after the prefill's token
        calls.clear()


def test_genlab_native_0_compiles_with_torch_compile_instead(library, monkeypatch):
    lean = LeanLlama.from_model(tiny("llama"))
    assert isinstance(lean.native_step(), native.NativeStep)
    monkeypatch.setenv("GENLAB_NATIVE", "0")
    assert lean.native_step() is None
    cache = lean.new_cache(8)
    logits = lean.prefill(torch.tensor([[1, 2]]), cache)
    lean.compiled_step(logits.argmax(-1, keepdim=True), cache)
    assert lean._compiled is not None


def test_without_a_compiler_compile_falls_back_to_torch_compile(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    native.build.cache_clear()
    try:
        lean = LeanLlama.from_model(tiny("llama"))
        assert "could not build lean_step.c" in native.applies(lean)
        assert lean.native_step() is None
    finally:
        native.build.cache_clear()


def test_a_compiler_error_is_reported_as_the_reason(monkeypatch, tmp_path):
    native.build.cache_clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        build = native.build(native.FLAGS + ("-fno-such-flag",))
        assert build.library is None
        assert "failed" in build.reason and "no-such-flag" in build.reason
    finally:
        native.build.cache_clear()


def test_the_library_is_built_once_and_then_read_from_the_cache(library, monkeypatch,
                                                                 tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.build.cache_clear()
    try:
        assert native.build().library is not None
        built = list((tmp_path / "genlab" / "native").glob("lean_step-*.so"))
        assert len(built) == 1
        native.build.cache_clear()

        def no_compiling(*args):
            raise AssertionError("compiled again")

        monkeypatch.setattr(native, "_compile", no_compiling)
        assert native.build().library is not None
    finally:
        native.build.cache_clear()


def test_a_token_outside_the_embeddings_is_refused(library):
    lean = LeanLlama.from_model(tiny("llama"))
    cache = lean.new_cache(8)
    lean.prefill(torch.tensor([[1, 2]]), cache)
    with pytest.raises(ValueError, match="outside the model's 512 embeddings"):
        native.NativeStep(lean, 1, library)(512, cache)


def test_a_full_cache_is_refused_before_the_kernel_writes_past_it(library):
    lean = LeanLlama.from_model(tiny("llama"))
    cache = lean.new_cache(3)
    lean.prefill(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="4 tokens exceed the KV buffers' 3"):
        native.NativeStep(lean, 1, library)(5, cache)


def test_a_cache_gets_scratch_for_the_step_that_runs_it(library):
    """Scratch is sized by the step's threads: a cache first run by a one-thread step
    gets new scratch from a two-thread one, and both follow the lean step."""
    lean = LeanLlama.from_model(odd_llama())
    one, two = native.NativeStep(lean, 1, library), native.NativeStep(lean, 2, library)
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
