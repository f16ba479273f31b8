"""The lean Llama forward (genlib/backends/llama.py) against transformers' own forward and
generate(): the same logits, the same greedy tokens, on real and tiny random models."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from genlib import generate
from genlib.backends import compiled, kernel
from genlib.backends.choose import Request, choose_backend
from genlib.backends.compiled import lean_compiled_step
from genlib.backends.lean import lean_model_of
from genlib.backends.llama import LeanLlama, _mm, _Proj
from genlib.events import Finish, Prefill
from genlib.settings.config import resolve_settings
from tests.conftest import (
    assert_lean_follows_transformers,
    tiny_config,
    torch_threads,
    transformers_backend,
)

STORY_PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the"]


def greedy(n: int):
    return resolve_settings({"max_new_tokens": n, "ignore_eos": True})


def hf_generate(lm, ids: list[int], n: int) -> list[int]:
    """transformers' generate(), greedy, run to n tokens whatever end ids it meets."""
    inputs = torch.tensor([ids])
    out = lm.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, pad_token_id=lm.pad_id)
    return out[0, len(ids):].tolist()


def genlab_greedy(lm, ids: list[int], n: int, backend: str = "lean") -> list[int]:
    """genlab's greedy loop on `backend` (the lean forward by default), checking that
    `backend` is the one that ran."""
    events = list(generate.stream(lm, [ids], greedy(n), backend=backend))
    prefill = next(e for e in events if isinstance(e, Prefill))
    assert backend == "auto" or prefill.backend == backend, prefill
    return list(events[-1].token_ids)


def hf_forward_greedy(lm, ids: list[int], n: int) -> list[int]:
    """genlab's loop over transformers' forward."""
    return genlab_greedy(lm, ids, n, backend="transformers")


def lean_greedy(lean: LeanLlama, ids: list[int], n: int, compiled: bool = False,
                eos: int = 2) -> list[int]:
    """Greedy over the lean forward, never picking `eos` (as min_new_tokens does)."""
    cache = lean.new_cache(len(ids) + n)
    logits = lean.prefill(torch.tensor([ids]), cache)
    step = partial(lean_compiled_step, lean) if compiled else lean.step
    out: list[int] = []
    for _ in range(n):
        token = logits.index_fill(-1, torch.tensor([eos]), float("-inf")).argmax(-1, keepdim=True)
        out.append(int(token))
        logits = step(token, cache)
    return out


def assert_lean_matches_generate(model, lean: LeanLlama, n: int = 60) -> None:
    """60 forced greedy tokens of a tiny random model: lean == transformers' generate()."""
    ids = [1, 5, 9, 200, 33]
    inputs = torch.tensor([ids])
    expected = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
    assert lean_greedy(lean, ids, n) == expected[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def tiny_llama():
    """A tiny random Llama with grouped-query attention (4 heads, 2 KV heads)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).eval()


@pytest.mark.parametrize("prompt", STORY_PROMPTS)
def test_lean_greedy_matches_hf_forward_and_generate_on_stories(stories, prompt):
    assert lean_model_of(stories) is not None
    ids = stories.encode(prompt)
    ours = genlab_greedy(stories, ids, 200)
    assert ours == hf_forward_greedy(stories, ids, 200)
    assert ours == hf_generate(stories, ids, 200)


def test_lean_greedy_matches_generate_on_llama2xs(llama2xs):
    for prompt in STORY_PROMPTS[:2]:
        ids = llama2xs.encode(prompt)
        n = 240 - len(ids)  # llama2xs has 256 positions
        ours = genlab_greedy(llama2xs, ids, n)
        assert ours == hf_forward_greedy(llama2xs, ids, n)
        assert ours == hf_generate(llama2xs, ids, n)


def test_lean_greedy_matches_generate_on_code_target(code_target):
    ids = code_target.encode("def fibonacci(n):\n    ")
    assert lean_model_of(code_target) is not None
    assert genlab_greedy(code_target, ids, 64) == hf_generate(code_target, ids, 64)


def test_lean_greedy_matches_generate_on_tiny_gqa_llama(tiny_llama):
    lean = LeanLlama.from_model(tiny_llama)
    assert lean is not None and lean.kv_heads < lean.heads
    for ids in ([1, 5, 9, 200, 33], [1, 400, 2, 17, 17, 17, 90, 3]):
        inputs = torch.tensor([ids])
        expected = tiny_llama.generate(inputs, attention_mask=torch.ones_like(inputs),
                                       max_new_tokens=100, min_new_tokens=100, do_sample=False,
                                       pad_token_id=0)[0, len(ids):].tolist()
        assert lean_greedy(lean, ids, 100) == expected


@pytest.mark.parametrize("which", ["stories", "tiny"])
def test_lean_logits_equal_hf_logits_at_prefill_and_after_steps(stories, tiny_llama, which):
    model = stories.model if which == "stories" else tiny_llama
    assert_lean_follows_transformers(model, LeanLlama.from_model(model),
                                     torch.tensor([[1, 43, 67, 120, 9, 300, 41]]))


@pytest.fixture
def two_threads():
    """torch on two threads, so the one-row products of large weights are split."""
    with torch_threads(2):
        yield


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="splits need MKL")
@pytest.mark.parametrize("k, n", [(384, 1152), (1024, 384), (384, 8192), (1000, 3072)])
def test_split_one_row_product_is_bit_identical_to_torch_mm(two_threads, k, n):
    weight = torch.randn(n, k).t()  # (K, N), as nn.Linear's weight transposed
    proj = _Proj.of(weight)
    assert proj.split is not None and proj.split.shape == (2, k, n // 2)
    for _ in range(3):
        x = torch.randn(1, k)
        assert torch.equal(_mm(x, proj), torch.mm(x, weight))
    rows = torch.randn(5, k)  # several rows take torch.mm itself
    assert torch.equal(_mm(rows, proj), torch.mm(rows, weight))


@pytest.mark.parametrize("k, n", [(384, 32002), (1024, 4100), (64, 1024)])
def test_products_whose_slices_would_not_be_exact_are_not_split(two_threads, k, n):
    """Slices of a width that is not a multiple of 4 take another MKL path (different
    bits); a weight under 1 MiB gains nothing from a second thread."""
    weight = torch.randn(n, k).t()
    assert _Proj.of(weight).split is None


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="splits need MKL")
def test_a_split_that_would_change_the_bits_is_dropped(two_threads, monkeypatch):
    import genlib.backends.llama

    weight = torch.randn(1152, 384).t()
    assert _Proj.of(weight).split is not None
    monkeypatch.setattr(genlib.backends.llama, "_same_as_mm", lambda w, split: False)
    assert _Proj.of(weight).split is None


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="splits need MKL")
def test_lean_steps_with_split_products_are_bit_identical_on_code_target(code_target,
                                                                         two_threads):
    model = code_target.model
    lean = LeanLlama.from_model(model)
    assert lean.lm_head.split is not None and lean.layers[0].gate_up.split is not None
    ids = torch.tensor([code_target.encode("def add(a, b):\n    return")])
    assert_lean_follows_transformers(model, lean, ids)


@pytest.mark.parametrize("which", ["stories", "tiny"])
def test_several_tokens_after_a_prefix_equal_hf_logits(stories, tiny_llama, which):
    """Speculative verification: k tokens after a cached prefix in one lean forward."""
    model = stories.model if which == "stories" else tiny_llama
    lean = LeanLlama.from_model(model)
    ids = torch.tensor([[1, 43, 67, 120, 9, 300, 41]])
    hf = transformers_backend(model)
    hf.prefill_ids(ids, torch.ones_like(ids))
    cache = lean.new_cache(64)
    lean.prefill(ids, cache)
    block = torch.tensor([[42, 7, 300, 2, 11]])
    torch.testing.assert_close(lean.extend(block, cache), hf.extend(block),
                               rtol=1e-4, atol=1e-4)
    assert cache.length == hf.length == 12
    cache.crop(9)  # roll back past two of them; the next step sees only the first two
    hf.crop(9)
    nxt = torch.tensor([[5]])
    torch.testing.assert_close(lean.step(nxt, cache), hf.step(nxt[:, 0]),
                               rtol=1e-4, atol=1e-4)
    assert cache.length == hf.length == 10


def test_crop_rolls_back_to_an_earlier_length(stories):
    lean = LeanLlama.from_model(stories.model)
    ids = torch.tensor([stories.encode("Once upon a time")])
    cache = lean.new_cache(64)
    lean.prefill(ids, cache)
    first = lean.step(torch.tensor([[42]]), cache)
    lean.step(torch.tensor([[7]]), cache)
    cache.crop(ids.shape[1])
    torch.testing.assert_close(lean.step(torch.tensor([[42]]), cache), first, rtol=0, atol=0)


def test_qwen2_with_qkv_biases_matches_generate():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2")).eval()
    lean = LeanLlama.from_model(model)
    assert lean is not None and lean.layers[0].qkv_bias is not None
    assert_lean_matches_generate(model, lean)


def test_other_architectures_are_not_eligible_and_still_generate(stories_tokenizer):
    from transformers import AutoModelForCausalLM

    from genlib.models.loading import wrap_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_neox")).eval()
    assert LeanLlama.from_model(model) is None
    lm = wrap_model(model, stories_tokenizer, ref="tiny-gpt_neox")
    assert lean_model_of(lm) is None
    backend = choose_backend(lm, Request())
    assert backend.name == "transformers"
    assert backend.reason == ("transformers' forward; the native backend runs the lean "
                              "forward, which cannot run tiny-gpt_neox: model_type 'gpt_neox' "
                              "is not one the lean forward runs (llama, mistral, qwen2, qwen3, "
                              "granite, phi3, gemma2, gemma3_text, gpt2)")
    ids = lm.encode("Once upon a time")
    assert genlab_greedy(lm, ids, 30, backend="auto") == hf_generate(lm, ids, 30)


def test_rope_scaling_that_changes_with_the_length_is_not_eligible():
    """dynamic and longrope recompute the frequencies as the sequence grows (linear,
    llama3 and yarn, computed once, run: tests/test_archs.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = tiny_config("llama")
    scaled = LlamaConfig(**{**config.to_dict(), "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}})
    assert LeanLlama.from_model(LlamaForCausalLM(scaled)) is None


def test_genlab_lean_0_switches_the_lean_path_off(stories, monkeypatch):
    assert choose_backend(stories, Request()).name in ("lean", "native")
    monkeypatch.setenv("GENLAB_LEAN", "0")
    backend = choose_backend(stories, Request())
    off = "transformers' forward; GENLAB_LEAN=0 keeps auto off genlib's own forwards"
    assert backend.name == "transformers" and backend.reason == off
    ids = stories.encode("Once upon a time")
    events = list(generate.stream(stories, [ids], greedy(10)))
    assert (events[0].backend, events[0].backend_reason) == ("transformers", off)
    assert list(events[-1].token_ids) == hf_generate(stories, ids, 10)


@pytest.mark.parametrize("backend", ["lean", "native"])
def test_generations_on_one_model_interleave(stories, backend):
    """Each generation has its own lean cache: one started while another waits leaves
    the other's tokens as they would have been."""
    if backend == "native" and kernel.build().library is None:
        pytest.skip(f"the native step cannot be built here: {kernel.build().reason}")
    ids, other = stories.encode("Once upon a time"), stories.encode("The dog")

    def run(prompt, n):
        return generate.generate(stories, [prompt], greedy(n), backend=backend)[0].token_ids

    expected, expected_other = run(ids, 20), run(other, 5)
    first = generate.stream(stories, [ids], greedy(20), backend=backend)
    assert next(first).backend == backend
    next(first)  # the first token
    assert run(other, 5) == expected_other
    assert [e for e in first if isinstance(e, Finish)][0].token_ids == expected


def count_compiled_steps(monkeypatch) -> list[int]:
    """A list that grows by one on every call of the compiled lean step."""
    calls: list[int] = []
    real = compiled.lean_compiled_step
    monkeypatch.setattr(compiled, "lean_compiled_step",
                        lambda *args: calls.append(1) or real(*args))
    return calls


def test_compiled_lean_step_gives_identical_tokens(stories, tiny_llama, monkeypatch):
    """torch.compile over the fixed-shape step (about 10 s per model on 2 cores): the
    compiled backend over the lean forward (the native one is tests/test_native.py)."""
    ids = stories.encode("Once upon a time")
    expected = genlab_greedy(stories, ids, 120)
    with monkeypatch.context() as patch:
        calls = count_compiled_steps(patch)
        assert genlab_greedy(stories, ids, 120, backend="compiled") == expected
        assert len(calls) == 119  # every step after the prefill's token
    lean = LeanLlama.from_model(tiny_llama)
    prompt = [1, 5, 9, 200]
    eager = lean_greedy(lean, prompt, 40)
    assert lean_greedy(lean, prompt, 40, compiled=True) == eager
    # Switching between the two mid-generation carries the cache across.
    cache = lean.new_cache(64)
    logits = lean.prefill(torch.tensor([prompt]), cache)
    mixed = []
    for i in range(12):
        token = logits.argmax(-1, keepdim=True)
        mixed.append(int(token))
        logits = (partial(lean_compiled_step, lean) if i // 4 == 1 else lean.step)(token, cache)
    assert mixed == eager[:12]
    # Back to the first buffer size, in newly allocated buffers, with another prompt: the
    # graph compiled for that size is called directly, reading the new buffers.
    other = [1, 77, 300, 12]
    assert lean_greedy(lean, other, 40, compiled=True) == lean_greedy(lean, other, 40)
    assert compiled._lean_steps[lean].direct_keys == [44, 64]


@pytest.mark.parametrize("sliding_window", [None, 64])
def test_mistral_with_and_without_sliding_window_matches_generate(sliding_window):
    """A window of 64: the prompt and 60 tokens pass it (tests/test_archs.py has more)."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(2)
    config = MistralConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, initializer_range=0.3,
                           sliding_window=sliding_window, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    lean = LeanLlama.from_model(model)
    assert lean.arch.window == (sliding_window or 0)
    assert_lean_matches_generate(model, lean)


def test_compiled_lean_step_gives_identical_tokens_on_code_target(code_target, monkeypatch):
    """torch.compile's step's products are its own reductions, not torch.mm's: same
    tokens."""
    ids = code_target.encode("def fibonacci(n):\n    ")
    expected = genlab_greedy(code_target, ids, 64)
    calls = count_compiled_steps(monkeypatch)
    assert genlab_greedy(code_target, ids, 64, backend="compiled") == expected
    assert len(calls) == 63


def test_compiled_step_in_bfloat16_reads_exactly_the_cached_tokens():
    """bfloat16 (what --dtype auto gives on a GPU) through the compiled step: attention
    reads exactly the cached tokens, as transformers' does; a mask over the whole buffer
    instead sums differently and parts from transformers' tokens at the 16th here. (The
    compiled step's fused products sum in their own order, which flips other prompts'
    near-ties in bfloat16: auto gives the CPU the lean forward there, tested below.)"""
    from genlib.models.loading import ModelSpec, load_model
    from tests.conftest import STORIES

    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    lm = load_model(ModelSpec(str(STORIES), dtype="bfloat16"))
    ids = lm.encode("Once upon a time")
    expected = hf_generate(lm, ids, 64)
    assert genlab_greedy(lm, ids, 64, backend="compiled") == expected
    assert genlab_greedy(lm, ids, 64, backend="lean") == expected


def test_auto_in_bfloat16_on_a_cpu_gives_transformers_tokens():
    """One row in bfloat16 on a CPU: auto picks the lean forward, whose greedy tokens are
    generate()'s where the compiled step's part from them (code-draft, this prompt, at
    the 14th token: a near-tie its own order of sums flips)."""
    from genlib.models.loading import ModelSpec, load_model
    from tests.conftest import CODE_DRAFT

    if not CODE_DRAFT.is_dir():
        pytest.skip("code-draft not present")
    lm = load_model(ModelSpec(str(CODE_DRAFT), dtype="bfloat16"))
    assert choose_backend(lm, Request()).name == "lean"
    ids = lm.encode("def fibonacci(n):")
    assert genlab_greedy(lm, ids, 64, backend="auto") == hf_generate(lm, ids, 64)


def test_compiled_step_from_an_empty_cache(stories):
    """A generation that starts with no cached token (a one-token prompt whose token the
    first step feeds, as speculation does): that first step runs eagerly, the graph is
    compiled for two or more cached tokens, and the tokens are the eager step's."""
    lean = lean_model_of(stories)

    def run(step) -> list[int]:
        cache = lean.new_cache(64)
        assert lean.prefill(torch.tensor([[]], dtype=torch.long), cache) is None
        token, out = torch.tensor([[1]]), []
        for _ in range(30):
            logits = step(token, cache)
            token = logits.argmax(-1, keepdim=True)
            out.append(int(token))
        return out

    assert run(partial(lean_compiled_step, lean)) == run(lean.step)


def test_compiled_step_compiles_where_sdpa_chooses_its_kernel_by_length(tiny_llama,
                                                                        monkeypatch):
    """CUDA's SDPA asks whether the attention's length is 1 while dynamo traces it; with
    torch 2.11, which read the position as an unhinted size, an H100 failed there in
    bfloat16 ("Could not guard on data-dependent expression Eq(u0 + 1, 1)"). This
    torch reads a step input's `.item()` as a hinted size, so here the position comes
    from an operation (unhinted, as there) and the CPU's SDPA asks the same question:
    it must compile and change nothing, since the step knows it reads two or more
    cached tokens."""
    plain_sdpa, plain_step = LeanLlama._sdpa, LeanLlama._static_step

    def sdpa_choosing_by_length(self, q, keys, values, end, mask=None, causal=False):
        if end == 1:  # one cached token: another kernel, in CUDA's choice
            return plain_sdpa(self, q, keys, values, end, mask, causal)
        return plain_sdpa(self, q, keys, values, end, mask, causal)

    def step_with_an_unhinted_position(self, token, position, keys, values):
        return plain_step(self, token, position * 1, keys, values)

    prompt = [1, 5, 9, 200]
    expected = lean_greedy(LeanLlama.from_model(tiny_llama), prompt, 20)
    monkeypatch.setattr(LeanLlama, "_sdpa", sdpa_choosing_by_length)
    monkeypatch.setattr(LeanLlama, "_static_step", step_with_an_unhinted_position)
    lean = LeanLlama.from_model(tiny_llama)
    assert lean_greedy(lean, prompt, 20, compiled=True) == expected
    assert compiled._lean_steps[lean].direct_keys == [24]
