"""gemma2 and gemma3 (genlib/backends/arch.py) on the lean forward and the native kernel:
transformers' greedy and beam tokens on tiny random models, 64 steps, float32 on both and
bfloat16 on lean; the kernel's vector paths and quantized formats; the configs they
refuse, by key.

The models are built so that each of gemma's differences from Llama's block changes the
tokens: norm weights drawn at random (transformers starts them at 0, which (1 + weight)
makes 1), a window of 24 that the prompt and 64 steps run past on the sliding layers
only, soft-caps small enough to bite, a query_pre_attn_scalar that is not head_dim; and
an lm_head of its own (tied to embeddings scaled by sqrt(hidden), a random model repeats
its last token)."""

from __future__ import annotations

import pytest
import torch

from genlib import generate
from genlib.backends.arch import Unsupported, describe
from genlib.backends.choose import Request, choose_backend
from genlib.backends.llama import LeanLlama
from genlib.models.loading import wrap_model
from tests.conftest import assert_lean_follows_transformers
from tests.test_archs import (
    PROMPT,
    STEPS,
    WINDOW,
    _common,
    assert_native_beam_is_generates,
    assert_native_follows_lean_on_build,
    assert_quantized_native_is_dequantized,
    assert_refused_naming,
    assert_varied,
)
from tests.test_lean import genlab_greedy, hf_generate
from tests.test_native import PORTABLE

ARCHS = ("gemma2", "gemma3")
# gemma3's vision-language model, run on text: its text model, with no logits soft-cap
# (transformers applies none there, whatever its text_config says).
VISION = "gemma3-vision"
ATTN_CAP, FINAL_CAP, QUERY_SCALAR = 2.0, 3.0, 24  # head_dim is 16


def gemma_config(arch: str, **changes):
    """A small gemma2 or gemma3 text config: 2 layers, the first sliding, the second
    full (VISION: a gemma3 vision-language config around it)."""
    from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig

    common = {**_common(), "head_dim": 16, "sliding_window": WINDOW,
              "query_pre_attn_scalar": QUERY_SCALAR, "pad_token_id": 0,
              "tie_word_embeddings": False, **changes}
    if arch == "gemma2":
        return Gemma2Config(**{"attn_logit_softcapping": ATTN_CAP,
                               "final_logit_softcapping": FINAL_CAP, **common})
    if arch == VISION:
        text = {**common, "sliding_window_pattern": 2, "final_logit_softcapping": FINAL_CAP}
        del text["tie_word_embeddings"]
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14)
        return Gemma3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return Gemma3TextConfig(**{"sliding_window_pattern": 2, **common})


def gemma_model(arch: str, dtype: torch.dtype = torch.float32, **changes):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma_config(arch, **changes)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.normal_(0.0, 0.5)
    return model.to(dtype)


def gemma_lm(arch: str, tokenizer, dtype: torch.dtype = torch.float32):
    return wrap_model(gemma_model(arch, dtype), tokenizer, ref=f"tiny-{arch}")


def test_describe_reads_gemmas_differences_from_the_config():
    two, three = describe(gemma_config("gemma2")), describe(gemma_config("gemma3"))
    for arch in (two, three):
        assert arch.window == WINDOW and arch.full_layers == (1,)
        assert arch.sandwich and arch.gelu and arch.embed_scale == 64 ** 0.5
        assert arch.scale(16) == QUERY_SCALAR ** -0.5
    assert (two.name, two.attn_softcap, two.final_softcap, two.eager) == \
        ("gemma2", ATTN_CAP, FINAL_CAP, True)
    assert (three.name, three.qk_norm, three.local_rope, three.attn_softcap) == \
        ("gemma3_text", True, True, None)
    assert not two.qk_norm and not two.local_rope and not three.eager
    vision = describe(gemma_config(VISION))
    assert vision.name == "gemma3" and vision.final_softcap is None
    assert vision.local_rope and vision.qk_norm and vision.full_layers == (1,)


def test_transformers_slides_the_layers_arch_says():
    """Which layers slide is transformers' choice (layer_types): the first of each pair
    for gemma2, five of six for gemma3 by default."""
    assert describe(gemma_config("gemma2", num_hidden_layers=4)).full_layers == (1, 3)
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**{**_common(), "num_hidden_layers": 7, "head_dim": 16,
                                 "sliding_window": WINDOW})
    assert describe(config).full_layers == (5,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS + (VISION,))
def test_lean_logits_equal_transformers_bit_for_bit(arch, dtype):
    """Past the window at prefill (a prompt longer than it) and while stepping."""
    model = gemma_model(arch, dtype)
    prompt = torch.tensor([PROMPT * 4])  # 32 tokens, past the window of 24
    assert_lean_follows_transformers(model, LeanLlama.from_model(model), prompt,
                                     tokens=list(range(3, 30)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS + (VISION,))
def test_lean_greedy_gives_generates_tokens(arch, dtype, stories_tokenizer):
    lm = gemma_lm(arch, stories_tokenizer, dtype)
    ours = genlab_greedy(lm, PROMPT, STEPS, backend="lean")
    assert_varied(ours)
    assert ours == hf_generate(lm, PROMPT, STEPS)


@pytest.mark.parametrize("layers", [2, 7], ids=["all-sliding", "one-full"])
def test_gemma3_with_its_default_pattern_gives_generates_tokens(layers, stories_tokenizer):
    """Five of six layers sliding: 2 layers have no full one, whose rope transformers
    then does not make; 7 have one, the sixth."""
    from transformers import AutoModelForCausalLM

    config = gemma_config("gemma3", num_hidden_layers=layers, sliding_window_pattern=6)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    lm = wrap_model(model, stories_tokenizer, ref="tiny-gemma3")
    assert describe(config).full_layers == ((5,) if layers == 7 else ())
    for backend in ("lean", "native"):
        ours = genlab_greedy(lm, PROMPT, STEPS, backend=backend)
        assert_varied(ours)
        assert ours == hf_generate(lm, PROMPT, STEPS)


@pytest.mark.parametrize("arch", ARCHS + (VISION,))
def test_native_greedy_gives_generates_tokens(arch, library, stories_tokenizer):
    lm = gemma_lm(arch, stories_tokenizer)
    name = describe(lm.model.config).name
    assert choose_backend(lm, Request()).reason == f"a float32 {name} model on the CPU"
    ours = genlab_greedy(lm, PROMPT, STEPS, backend="native")
    assert_varied(ours)
    assert ours == hf_generate(lm, PROMPT, STEPS)


@pytest.mark.parametrize("arch", ARCHS)
def test_native_beam_search_gives_generates_tokens(arch, library, stories_tokenizer):
    assert_native_beam_is_generates(gemma_lm(arch, stories_tokenizer))


@pytest.mark.parametrize("flags", list(PORTABLE.values()), ids=list(PORTABLE))
@pytest.mark.parametrize("arch", ARCHS)
def test_native_step_follows_the_lean_step_on_each_vector_path(arch, flags):
    """gelu's vectorized gate on AVX-512, AVX2 and the generic build."""
    assert_native_follows_lean_on_build(gemma_model(arch), flags)


@pytest.mark.parametrize("name", ["q8_0", "nf4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_native_gives_the_dequantized_forwards_tokens(arch, name):
    """--quantize 8bit and 4bit: the kernel over the quantized matrices gives the greedy
    tokens of the lean forward over their dequantized values."""
    assert_quantized_native_is_dequantized(gemma_model(arch), name)


@pytest.mark.parametrize("backend", ["lean", "native"])
@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_past_the_window_gives_generates_tokens(arch, backend, library,
                                                            stories_tokenizer):
    """Verifying drafted tokens feeds several tokens after the cached ones, each under
    its layer's window (the model as its own draft: every proposal is accepted)."""
    from genlib.decoding.speculative import Drafting
    from tests.test_lean import greedy

    lm, draft = gemma_lm(arch, stories_tokenizer), gemma_lm(arch, stories_tokenizer)
    [drafted] = generate.generate(lm, [PROMPT], greedy(STEPS), backend=backend,
                                  drafter=Drafting(draft_lm=draft, num_draft_tokens=5))
    assert_varied(list(drafted.token_ids))
    assert list(drafted.token_ids) == hf_generate(lm, PROMPT, STEPS)


@pytest.mark.parametrize("arch, changes, key", [
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention True"),
    ("gemma2", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                     "rope_theta": 1e4}), "rope_parameters.rope_type 'dynamic'"),
    ("gemma3", dict(rope_parameters={
        "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "rope_parameters.sliding_attention.rope_type 'dynamic'"),
])
def test_configs_it_cannot_follow_are_refused_naming_the_key(arch, changes, key,
                                                             stories_tokenizer):
    """Auto falls back to transformers and says why; a forced lean or native backend is
    refused, in one line naming the key."""
    config = gemma_config(arch, **changes)
    with pytest.raises(Unsupported, match=key.replace(".", r"\.")):
        describe(config)
    lm = wrap_model(gemma_model(arch, **changes), stories_tokenizer, ref="m")
    assert_refused_naming(lm, key)
