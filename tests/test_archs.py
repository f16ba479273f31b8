"""The architectures beside Llama (genlib/backends/arch.py) on the lean forward and the
native kernel: transformers' greedy and beam tokens on tiny random models of each, 64
steps, float32 on both and bfloat16 on lean; and the configs they refuse, by key."""

from __future__ import annotations

import pytest
import torch

from genlib import generate
from genlib.backends.arch import Unsupported, describe
from genlib.backends.choose import Request, choose_backend
from genlib.backends.llama import LeanLlama, refusal
from genlib.errors import ConfigError
from genlib.events import Prefill
from genlib.models.loading import wrap_model
from genlib.settings.config import GenerationSettings
from tests.conftest import assert_lean_follows_transformers
from tests.test_beam import hf_beam
from tests.test_lean import genlab_greedy, hf_generate

STEPS = 64
PROMPT = [1, 5, 9, 200, 33, 71, 402, 17]
WINDOW = 24  # mistral's sliding window: the prompt and 64 steps run well past it


def _common() -> dict:
    return dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                initializer_range=0.2, bos_token_id=1, eos_token_id=2)


def arch_config(arch: str):
    """A small random config of `arch` whose one difference from Llama is not neutral."""
    from transformers import GraniteConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen3Config

    if arch == "qwen3":  # head_dim given apart from hidden / heads, as Qwen3's are
        return Qwen3Config(head_dim=24, **_common())
    if arch == "mistral":
        return MistralConfig(sliding_window=WINDOW, **_common())
    if arch == "granite":
        return GraniteConfig(embedding_multiplier=4.0, residual_multiplier=0.4,
                             attention_multiplier=0.2, logits_scaling=1.5, **_common())
    if arch == "phi3":  # fused products, and a window as Phi-3-mini-4k's (2047) has; an
        # intermediate size whose rows end in a vector tail (silu on the strided gate)
        return Phi3Config(sliding_window=WINDOW, pad_token_id=0,
                          **{**_common(), "intermediate_size": 72})
    if arch in ROPES:  # llama with a rope scaling computed once
        rope = {"rope_type": arch, "factor": 2.0, "rope_theta": 10000.0}
        if arch in ("yarn", "llama3"):
            rope["original_max_position_embeddings"] = 64
        if arch == "llama3":  # Llama 3.1's bands, over a short original context
            rope |= {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        return LlamaConfig(rope_parameters=rope, **_common())
    raise ValueError(arch)


ARCHS = ("qwen3", "mistral", "granite", "phi3")
ROPES = ("linear", "yarn", "llama3")  # the rope scalings the lean forward follows


def arch_model(arch: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(arch_config(arch)).eval().to(dtype)


def arch_lm(arch: str, tokenizer, dtype: torch.dtype = torch.float32):
    return wrap_model(arch_model(arch, dtype), tokenizer, ref=f"tiny-{arch}")


def assert_varied(tokens: list[int]) -> None:
    """Tokens that test something: not one token repeated (a degenerate random model)."""
    assert len(tokens) == STEPS and len(set(tokens)) >= 10, tokens


@pytest.mark.parametrize("arch", ARCHS + ROPES)
def test_describe_reads_each_difference_from_the_config(arch):
    got = describe(arch_config(arch))
    expected = {"qwen3": dict(qk_norm=True), "mistral": dict(window=WINDOW),
                "phi3": dict(fused=True, window=WINDOW),
                "granite": dict(embedding_multiplier=4.0, residual_multiplier=0.4,
                                attention_multiplier=0.2, logits_scaling=1.5)}.get(arch, {})
    assert got.name == ("llama" if arch in ROPES else arch)
    for field, value in expected.items():
        assert getattr(got, field) == value


@pytest.mark.parametrize("arch", ARCHS + ("yarn", "llama3"))
def test_lean_logits_equal_transformers_bit_for_bit(arch):
    """Past mistral's window at prefill (a prompt longer than it) and while stepping."""
    model = arch_model(arch)
    prompt = torch.tensor([PROMPT * 4])  # 32 tokens, past the window of 24
    assert_lean_follows_transformers(model, LeanLlama.from_model(model), prompt,
                                     tokens=list(range(3, 30)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS + ROPES)
def test_lean_greedy_gives_generates_tokens(arch, dtype, stories_tokenizer):
    lm = arch_lm(arch, stories_tokenizer, dtype)
    ours = genlab_greedy(lm, PROMPT, STEPS, backend="lean")
    assert_varied(ours)
    assert ours == hf_generate(lm, PROMPT, STEPS)


@pytest.mark.parametrize("arch", ARCHS + ("yarn", "llama3"))
def test_native_greedy_gives_generates_tokens(arch, library, stories_tokenizer):
    lm = arch_lm(arch, stories_tokenizer)
    name = "llama" if arch in ROPES else arch
    assert choose_backend(lm, Request()).reason == f"a float32 {name} model on the CPU"
    ours = genlab_greedy(lm, PROMPT, STEPS, backend="native")
    assert_varied(ours)
    assert ours == hf_generate(lm, PROMPT, STEPS)


def assert_refused_naming(lm, key: str) -> None:
    """A model whose config has `key` (an arithmetic genlab does not follow): auto falls
    back to transformers naming it, and a forced lean or native backend is refused in one
    line naming it."""
    assert key in refusal(lm.model)
    auto = choose_backend(lm, Request())
    assert auto.name == "transformers" and key in auto.reason
    for name in ("lean", "native"):
        with pytest.raises(ConfigError) as error:
            choose_backend(lm, Request(backend=name))
        message = str(error.value)
        assert key in message and "\n" not in message


def assert_native_beam_is_generates(lm) -> None:
    """Beam search (k=4, four sequences, STEPS tokens) on the native backend gives
    transformers' generate() sequences, and they vary."""
    settings = GenerationSettings(strategy="beam", num_beams=4, num_return_sequences=4,
                                  max_new_tokens=STEPS, min_new_tokens=STEPS)
    events = list(generate.stream(lm, [PROMPT], settings, backend="native"))
    assert next(e for e in events if isinstance(e, Prefill)).backend == "native"
    ours = [list(f.token_ids) for f in generate.generate(lm, [PROMPT], settings,
                                                         backend="native")]
    rows, _ = hf_beam(lm, [PROMPT], settings)
    assert_varied(ours[0])
    assert ours == rows


def assert_native_follows_lean_on_build(model, flags: tuple[str, ...]) -> None:
    """The kernel built with `flags` (a vector path), on one and two threads, follows the
    lean forward over `model` (tests.test_native.assert_native_follows_lean)."""
    from genlib.backends import kernel
    from tests.test_native import assert_native_follows_lean

    build = kernel.build(kernel.FLAGS + flags)
    if build.library is None:
        pytest.skip(f"no build here: {build.reason}")
    lean = LeanLlama.from_model(model)
    for threads in (1, 2):
        step = kernel.NativeStep(lean, threads, build.library)
        assert_native_follows_lean(lean, step, PROMPT, steps=48)


def assert_quantized_native_is_dequantized(model, name: str) -> None:
    """The kernel over `model`'s matrices quantized as `name` (q8_0, nf4) gives the
    greedy tokens of the lean forward over their dequantized values, and they vary."""
    from genlib.backends import kernel
    from tests.test_quantized import dequantized, greedy_lean, greedy_native, quantized_build

    library = quantized_build(name)
    lean = LeanLlama.from_model(model)
    step = kernel.NativeStep(lean, 2, library, weights=name)
    want = greedy_lean(LeanLlama.from_model(dequantized(model, name)), PROMPT, STEPS)
    assert_varied(want)
    assert greedy_native(step, lean, PROMPT, STEPS) == want


@pytest.mark.parametrize("arch", ARCHS)
def test_native_beam_search_gives_generates_tokens(arch, library, stories_tokenizer):
    assert_native_beam_is_generates(arch_lm(arch, stories_tokenizer))


@pytest.mark.parametrize("config, key", [
    (lambda: arch_config("linear").__class__(
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
        **_common()), "rope_parameters.rope_type 'dynamic'"),
    (lambda: arch_config("phi3").__class__(pad_token_id=0, rope_parameters={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "rope_theta": 1e4}, original_max_position_embeddings=64, **_common()),
     "rope_parameters.rope_type 'longrope'"),
    (lambda: arch_config("linear").__class__(
        attn_logit_softcapping=30.0, **_common()), "attn_logit_softcapping 30.0"),
    (lambda: arch_config("qwen3").__class__(use_sliding_window=True, sliding_window=16,
                                            **_common()), "use_sliding_window True"),
    (lambda: arch_config("linear").__class__(hidden_act="gelu", **_common()),
     "hidden_act 'gelu'"),
])
def test_configs_it_cannot_follow_are_refused_naming_the_key(config, key, stories_tokenizer):
    """An unsupported rope type or an arithmetic key not implemented: auto falls back to
    transformers and says why, a forced lean or native backend is refused, in one line
    naming the key."""
    from transformers import AutoModelForCausalLM

    cfg = config()
    with pytest.raises(Unsupported, match=key.replace(".", r"\.")):
        describe(cfg)
    torch.manual_seed(0)
    lm = wrap_model(AutoModelForCausalLM.from_config(cfg).eval(), stories_tokenizer, ref="m")
    assert_refused_naming(lm, key)


@pytest.mark.parametrize("backend", ["lean", "native"])
def test_speculation_past_mistrals_window_gives_generates_tokens(backend, library,
                                                                 stories_tokenizer):
    """Verifying drafted tokens feeds several tokens after the cached ones, each under
    the window (the model as its own draft: every proposal is accepted)."""
    from genlib.decoding.speculative import Drafting
    from tests.test_lean import greedy

    lm = arch_lm("mistral", stories_tokenizer)
    draft = arch_lm("mistral", stories_tokenizer)
    [drafted] = generate.generate(lm, [PROMPT], greedy(STEPS), backend=backend,
                                  drafter=Drafting(draft_lm=draft, num_draft_tokens=5))
    assert_varied(list(drafted.token_ids))
    assert list(drafted.token_ids) == hf_generate(lm, PROMPT, STEPS)
