"""What an architecture changes in the Llama block, read from a model's config into one
description (`Arch`) that the lean forward (`genlib.backends.llama`) and the native
kernel (`genlib.backends.kernel`, `csrc/lean_step.c`) both follow.

    arch = describe(config)   # an Arch, or Unsupported naming the key it cannot follow

Each architecture is a few declared differences from Llama's forward:

| model_type | differences |
| --- | --- |
| llama | none |
| qwen2 | q/k/v products add biases |
| qwen3 | per-head RMSNorm on q and k, before the rotary embedding |
| mistral | a sliding window: each token attends to the last `sliding_window` tokens |
| phi3 | q/k/v and gate/up stored as one matrix each (split at load); mistral's window |
| granite | embeddings, residual branches, attention scores (for 1/sqrt(head_dim)) and  |
|  | logits scaled by the config's multipliers |
| gemma2 | embeddings times sqrt(hidden) in the model's dtype; RMSNorm by (1 + weight) in |
|  | float32, also on each sublayer's output; GeGLU (gelu, tanh approximation); scores |
|  | scaled by query_pre_attn_scalar**-0.5 and soft-capped; logits soft-capped; the |
|  | window on the layers `layer_types` calls sliding; attention as transformers' eager |
| gemma3_text | gemma2's block with per-head (1 + weight) q/k norms, no score soft-cap, |
|  | and a rope of its own (`rope_parameters["sliding_attention"]`) on sliding layers |
| gemma3 | Gemma 3's vision-language model on text: its `text_config`'s gemma3_text, |
|  | without the logits' soft-cap (Gemma3ForConditionalGeneration applies none) |
| gpt2 | LayerNorm (weight and bias) for RMSNorm; learned absolute positions added to |
|  | the embeddings, no rope; an MLP without a gate, act(fc) (`activation_function`); |
|  | a bias on every projection; one fused q/k/v product (`c_attn`); Conv1D weights |
|  | ([in, out], read transposed); no grouped heads; the lm_head tied |

A config key that would change the arithmetic in a way this description cannot say (a
rope type computed per length, a soft-cap, a window on a model whose window is not
implemented) is refused with `Unsupported`, whose message names the key: never a silent
approximation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "gemma2",
                 "gemma3_text", "gpt2")
GEMMA = ("gemma2", "gemma3_text")
# The layer types of gemma's `layer_types`: a sliding one attends to the last
# `sliding_window` tokens.
LAYER_TYPES = ("sliding_attention", "full_attention")
# Rope types whose frequencies the model computes once (the lean forward takes them from
# the model's rotary embedding, with its attention scaling); "dynamic" and "longrope"
# change them with the sequence's length.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# gpt2's `activation_function`s, as the lean forward names them: "gelu_new" is the tanh
# approximation as transformers' NewGELUActivation writes it out, "gelu_tanh" torch's own
# kernel of the same (gemma's too), "gelu" the exact (erf) one.
GPT2_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_tanh",
                    "gelu": "gelu"}
# gpt2 config flags that change the arithmetic when set, not run here.
_GPT2_REFUSED = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                 "add_cross_attention")
# Keys that change the arithmetic in some architecture, and the value that leaves it as
# Llama's; each architecture lists those it follows (`_FOLLOWS`).
_ARITHMETIC = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0,
               "attention_multiplier": None, "logits_scaling": 1.0,
               "attn_logit_softcapping": None, "final_logit_softcapping": None,
               "query_pre_attn_scalar": None, "use_sliding_window": False,
               "sliding_window": None, "use_qk_norm": False, "qk_layernorm": False,
               "partial_rotary_factor": 1.0, "logit_scale": None,
               "use_bidirectional_attention": False}
_FOLLOWS = {"mistral": {"sliding_window"}, "phi3": {"sliding_window"},
            "granite": {"embedding_multiplier", "residual_multiplier",
                        "attention_multiplier", "logits_scaling"},
            "gemma2": {"attn_logit_softcapping", "final_logit_softcapping",
                       "query_pre_attn_scalar", "sliding_window"},
            # transformers' Gemma3Attention passes no soft-cap: the key changes nothing
            "gemma3_text": {"attn_logit_softcapping", "final_logit_softcapping",
                            "query_pre_attn_scalar", "sliding_window"}}


class Unsupported(ValueError):
    """A config the lean forward cannot follow exactly; the message names the key."""


@dataclass(frozen=True)
class Arch:
    """The differences from Llama's block, as the forward applies them."""

    name: str
    qkv_bias: bool = False  # q/k/v products add biases (qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (qwen3)
    fused: bool = False  # q/k/v and gate/up held as one matrix each (phi3)
    window: int = 0  # attention sees the last `window` tokens; 0: all (mistral)
    embedding_multiplier: float = 1.0  # granite's, from here on
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # None: 1/sqrt(head_dim)
    logits_scaling: float = 1.0  # logits are divided by it
    # gemma's, from here on
    embed_scale: float | None = None  # embeddings times it, rounded to the model's dtype
    sandwich: bool = False  # RMSNorm by (1 + weight), in float32, also on sublayer outputs
    activation: str = "silu"  # the MLP's: silu, gelu_tanh (gemma), gelu_new or gelu (gpt2)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    eager: bool = False  # attention as transformers' eager path computes it (gemma2)
    full_layers: tuple[int, ...] = ()  # layers that see every token despite `window`
    local_rope: bool = False  # the other (sliding) layers take a rope of their own (gemma3)
    # gpt2's, from here on
    layernorm: bool = False  # LayerNorm (mean removed, weight and bias), not RMSNorm
    positions: str = "rope"  # "learned": absolute position embeddings added, no rope
    gated: bool = True  # the MLP is act(gate) * up; False: act(fc) alone
    biases: bool = False  # every projection adds a bias (the o, fc and down ones too)

    @property
    def gelu(self) -> bool:
        """The MLP's activation is gelu's tanh approximation (gemma's GeGLU, gpt2's)."""
        return self.activation in ("gelu_tanh", "gelu_new")

    def window_of(self, layer: int) -> int:
        """Layer `layer`'s window (0: it sees every token)."""
        return 0 if layer in self.full_layers else self.window

    def uncompiled(self) -> str | None:
        """Why the compiled lean step does not run this architecture; None: it does."""
        if self.window:
            return f"the compiled lean step does not run {self.name}'s sliding window"
        if self.sandwich or self.layernorm:
            return f"the compiled lean step does not run {self.name}'s block"
        return None

    def scale(self, head_dim: int) -> float:
        """The attention scores' scale."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return head_dim ** -0.5


def describe(config: Any) -> Arch:
    """The `Arch` of a model config (transformers' or config.json's fields as
    attributes); `Unsupported` where the lean forward cannot follow it exactly."""
    name = getattr(config, "model_type", None)
    if name == "gemma3":
        text = getattr(config, "text_config", None)
        if getattr(text, "model_type", None) != "gemma3_text":
            raise Unsupported("model_type 'gemma3' without a gemma3_text text_config")
        return replace(describe(text), name="gemma3", final_softcap=None)
    if name not in ARCHITECTURES:
        raise Unsupported(f"model_type {name!r} is not one the lean forward runs "
                          f"({', '.join(ARCHITECTURES)})")
    if name == "gpt2":
        return _gpt2(config)
    _check_plain(config, name)
    _check_rope(config, name)
    _check_keys(config, name)
    if name in GEMMA:
        return _gemma(config, name)
    if name == "granite":
        return Arch(name, embedding_multiplier=float(config.embedding_multiplier),
                    residual_multiplier=float(config.residual_multiplier),
                    attention_multiplier=float(config.attention_multiplier),
                    logits_scaling=float(config.logits_scaling))
    return Arch(name, qkv_bias=name == "qwen2", qk_norm=name == "qwen3",
                fused=name == "phi3",
                window=_window(config) if name in ("mistral", "phi3") else 0)


def _gemma(config: Any, name: str) -> Arch:
    """gemma2's and gemma3's block (transformers' Gemma2Model, Gemma3TextModel)."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers or set(types) - set(LAYER_TYPES):
        raise Unsupported(f"layer_types {types!r} (the lean forward runs one of "
                          f"{', '.join(LAYER_TYPES)} per layer)")
    window = _window(config)
    full = tuple(i for i, kind in enumerate(types) if kind == "full_attention")
    soft = getattr(config, "attn_logit_softcapping", None) if name == "gemma2" else None
    final = getattr(config, "final_logit_softcapping", None)
    return Arch(name, qk_norm=name == "gemma3_text", window=window,
                attention_multiplier=float(config.query_pre_attn_scalar) ** -0.5,
                embed_scale=config.hidden_size ** 0.5, sandwich=True, activation="gelu_tanh",
                attn_softcap=None if soft is None else float(soft),
                final_softcap=None if final is None else float(final),
                eager=name == "gemma2", full_layers=full,
                local_rope=name == "gemma3_text")


def _gpt2(config: Any) -> Arch:
    """gpt2's block (transformers' GPT2LMHeadModel)."""
    act = getattr(config, "activation_function", None)
    if act not in GPT2_ACTIVATIONS:
        raise Unsupported(f"activation_function {act!r} (the lean forward runs "
                          f"{', '.join(GPT2_ACTIVATIONS)} for gpt2)")
    for key in _GPT2_REFUSED:
        if getattr(config, key, False):
            raise Unsupported(f"{key} {getattr(config, key)!r} (the lean forward does not "
                              f"run it for gpt2)")
    if getattr(config, "quantization_config", None) is not None:
        raise Unsupported("quantization_config (a quantized model)")
    _check_keys(config, "gpt2")
    # scale_attn_weights False: scores not divided by sqrt(head_dim)
    unscaled = getattr(config, "scale_attn_weights", True) is False
    return Arch("gpt2", qkv_bias=True, activation=GPT2_ACTIVATIONS[act],
                attention_multiplier=1.0 if unscaled else None, layernorm=True,
                positions="learned", gated=False, biases=True)


def _window(config: Any) -> int:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return 0
    if not isinstance(window, int) or window < 1:
        raise Unsupported(f"sliding_window {window!r} is not a positive number of tokens")
    return window


def _check_plain(config: Any, name: str) -> None:
    """The parts every architecture here shares with Llama: SiLU's gated MLP without
    biases, no tensor-parallel slicing, unquantized weights."""
    key, runs = ("hidden_activation", "gelu_pytorch_tanh") if name in GEMMA else \
        ("hidden_act", "silu")
    if getattr(config, key, None) != runs:
        raise Unsupported(f"{key} {getattr(config, key, None)!r} (the lean forward runs "
                          f"{runs} for {name})")
    if getattr(config, "mlp_bias", False):
        raise Unsupported("mlp_bias")
    if name != "qwen2" and getattr(config, "attention_bias", False):
        raise Unsupported("attention_bias")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise Unsupported("pretraining_tp")
    if getattr(config, "quantization_config", None) is not None:
        raise Unsupported("quantization_config (a quantized model)")


def _check_rope(config: Any, name: str) -> None:
    ropes = getattr(config, "rope_parameters", None) or {}
    if name == "gemma3_text":  # one rope per layer type
        for kind in LAYER_TYPES:
            _check_one_rope(ropes.get(kind) or {}, f"rope_parameters.{kind}.")
    else:
        _check_one_rope(ropes, "rope_parameters.")


def _check_one_rope(rope: dict, where: str) -> None:
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise Unsupported(f"{where}rope_type {kind!r} (the lean forward runs "
                          f"{', '.join(ROPE_TYPES)})")
    if "rope_theta" not in rope:
        raise Unsupported(f"{where.rstrip('.')} without rope_theta")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported(f"{where}partial_rotary_factor")


def _check_keys(config: Any, name: str) -> None:
    for key, neutral in _ARITHMETIC.items():
        if key in _FOLLOWS.get(name, ()):
            continue
        value = getattr(config, key, neutral)
        if neutral is False and value is None:  # an unset flag
            value = False
        if value != neutral and not (key == "sliding_window" and _window_unused(config)):
            raise Unsupported(f"{key} {value!r} (the lean forward does not run it for "
                              f"{name})")


def _window_unused(config: Any) -> bool:
    """qwen2/qwen3 configs carry a `sliding_window` that only `use_sliding_window` turns
    on (then refused by its own key)."""
    return getattr(config, "use_sliding_window", None) is False
