"""gpt2 (genlib/backends/arch.py, genlib/backends/gpt2.py) on the lean forward and the
native kernel: transformers' greedy and beam tokens on tiny random models, 64 steps,
float32 on both and bfloat16 on lean; the kernel's vector paths and quantized formats;
the configs it refuses, by key, and positions past n_positions.

The models are built so that each of gpt2's differences from Llama's block changes the
tokens: transformers starts every bias at 0 and every LayerNorm at weight 1, bias 0, so
those are drawn at random here; its position embeddings are drawn with the weights
(initializer_range 0.2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from genlib import generate
from genlib.backends.arch import Unsupported, describe
from genlib.backends.choose import Request, choose_backend
from genlib.backends.llama import LeanLlama
from genlib.models.loading import wrap_model
from tests.conftest import ROOT, STORIES, assert_lean_follows_transformers
from tests.test_archs import (
    PROMPT,
    STEPS,
    assert_native_beam_is_generates,
    assert_native_follows_lean_on_build,
    assert_quantized_native_is_dequantized,
    assert_refused_naming,
    assert_varied,
)
from tests.test_lean import genlab_greedy, hf_generate
from tests.test_native import PORTABLE

# transformers' names: gelu_new (GPT-2's own), torch's tanh kernel, the exact gelu
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu")


def gpt2_config(**changes):
    """A small GPT-2 config: 2 layers, hidden 64 in 4 heads, 256 positions."""
    from transformers import GPT2Config

    return GPT2Config(**{**dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4,
                                n_positions=256, initializer_range=0.2, bos_token_id=1,
                                eos_token_id=2), **changes})


def gpt2_model(dtype: torch.dtype = torch.float32, **changes):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gpt2_config(**changes)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("bias"):  # large enough to change tokens, small enough
                weight.normal_(0.0, 0.1)  # that a tied lm_head's output still varies
            elif ".ln_" in name:  # the LayerNorms' weights
                weight.normal_(1.0, 0.5)
    return model.to(dtype)


def gpt2_lm(tokenizer, dtype: torch.dtype = torch.float32, **changes):
    return wrap_model(gpt2_model(dtype, **changes), tokenizer, ref="tiny-gpt2")


def test_describe_reads_gpt2s_differences_from_the_config():
    arch = describe(gpt2_config())
    assert (arch.name, arch.layernorm, arch.positions, arch.gated, arch.biases) == \
        ("gpt2", True, "learned", False, True)
    assert arch.activation == "gelu_new" and arch.gelu and arch.scale(16) == 16 ** -0.5
    assert arch.uncompiled() == "the compiled lean step does not run gpt2's block"
    assert describe(gpt2_config(activation_function="gelu")).activation == "gelu"
    assert describe(gpt2_config(scale_attn_weights=False)).scale(16) == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_lean_logits_equal_transformers_bit_for_bit(activation, dtype):
    model = gpt2_model(dtype, activation_function=activation)
    assert_lean_follows_transformers(model, LeanLlama.from_model(model),
                                     torch.tensor([PROMPT * 4]), tokens=list(range(3, 30)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lean_greedy_gives_generates_tokens(dtype, stories_tokenizer):
    lm = gpt2_lm(stories_tokenizer, dtype)
    ours = genlab_greedy(lm, PROMPT, STEPS, backend="lean")
    assert_varied(ours)
    assert ours == hf_generate(lm, PROMPT, STEPS)


@pytest.mark.parametrize("changes", [{}, dict(activation_function="gelu"),
                                     dict(scale_attn_weights=False)],
                         ids=["gelu_new", "exact-gelu", "unscaled-scores"])
def test_native_greedy_gives_generates_tokens(changes, library, stories_tokenizer):
    lm = gpt2_lm(stories_tokenizer, **changes)
    assert choose_backend(lm, Request()).reason == "a float32 gpt2 model on the CPU"
    ours = genlab_greedy(lm, PROMPT, STEPS, backend="native")
    assert_varied(ours)
    assert ours == hf_generate(lm, PROMPT, STEPS)


def test_native_beam_search_gives_generates_tokens(library, stories_tokenizer):
    assert_native_beam_is_generates(gpt2_lm(stories_tokenizer))


@pytest.mark.parametrize("flags", list(PORTABLE.values()), ids=list(PORTABLE))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_native_step_follows_the_lean_step_on_each_vector_path(activation, flags):
    """LayerNorm, the biases, learned positions and each activation on AVX-512, AVX2
    and the generic build: logits within float32 rounding, the same KV cache."""
    assert_native_follows_lean_on_build(gpt2_model(activation_function=activation), flags)


@pytest.mark.parametrize("name", ["q8_0", "nf4"])
def test_quantized_native_gives_the_dequantized_forwards_tokens(name):
    """--quantize 8bit and 4bit: the kernel over the quantized matrices gives the greedy
    tokens of the lean forward over their dequantized values."""
    assert_quantized_native_is_dequantized(gpt2_model(), name)


@pytest.mark.parametrize("backend", ["lean", "native"])
def test_speculation_gives_generates_tokens(backend, library, stories_tokenizer):
    """Verifying drafted tokens feeds several tokens at once, each at its own position
    (the model as its own draft: every proposal is accepted)."""
    from genlib.decoding.speculative import Drafting
    from tests.test_lean import greedy

    lm, draft = gpt2_lm(stories_tokenizer), gpt2_lm(stories_tokenizer)
    [drafted] = generate.generate(lm, [PROMPT], greedy(STEPS), backend=backend,
                                  drafter=Drafting(draft_lm=draft, num_draft_tokens=5))
    assert_varied(list(drafted.token_ids))
    assert list(drafted.token_ids) == hf_generate(lm, PROMPT, STEPS)


REFUSED = [(dict(activation_function="relu"), "activation_function 'relu'"),
           (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx True"),
           (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn True")]


@pytest.mark.parametrize("changes, key", REFUSED, ids=[key for _, key in REFUSED])
def test_configs_it_cannot_follow_are_refused_naming_the_key(changes, key,
                                                             stories_tokenizer):
    """Auto falls back to transformers and says why; a forced lean or native backend is
    refused, in one line naming the key."""
    with pytest.raises(Unsupported, match=key):
        describe(gpt2_config(**changes))
    lm = gpt2_lm(stories_tokenizer, **changes)
    assert_refused_naming(lm, key)


def saved_gpt2(folder, **changes):
    """A tiny gpt2 folder with stories260K's tokenizer."""
    gpt2_model(**changes).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(STORIES / name)
    return folder


def run_cli(folder, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "generate", "Once upon a time",
                           "-m", str(folder), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_the_cli_refuses_a_forced_native_backend_and_positions_past_n_positions(tmp_path):
    """Exit 2 with one line: naming the config key the native backend cannot run, and
    the model's positions when the prompt and new tokens exceed them."""
    if not STORIES.is_dir():
        pytest.skip("stories260K tokenizer not present")
    relu = saved_gpt2(tmp_path / "relu", activation_function="relu")
    done = run_cli(relu, "--backend", "native", "--max-new-tokens", "4")
    assert done.returncode == 2, done.stderr
    assert "activation_function 'relu'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    short = saved_gpt2(tmp_path / "short", n_positions=16)
    done = run_cli(short, "--backend", "native", "--max-new-tokens", "14")
    assert done.returncode == 2, done.stderr
    assert "16 positions" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    done = run_cli(short, "--backend", "native", "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr


def test_contrastive_search_on_the_lean_forward_follows_the_reference(stories_tokenizer):
    """The candidates all sit at the next position (its learned position embedding) and
    their hidden states come after ln_f."""
    from tests.test_contrastive_search import genlab_tokens, reference_contrastive

    lm = gpt2_lm(stories_tokenizer)
    assert choose_backend(lm, Request(hidden="contrastive search")).name == "lean"
    expected = reference_contrastive(lm.model, PROMPT, 0.6, 4, 32, lm.eos_ids)
    assert len(set(expected)) > 8 and expected != hf_generate(lm, PROMPT, len(expected))
    assert genlab_tokens(lm, PROMPT, penalty_alpha=0.6, top_k=4) == expected
