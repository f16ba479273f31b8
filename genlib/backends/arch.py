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

A config key that would change the arithmetic in a way this description cannot say (a
rope type computed per length, a soft-cap, a window on a model whose window is not
implemented) is refused with `Unsupported`, whose message names the key: never a silent
approximation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "granite", "phi3")
# Rope types whose frequencies the model computes once (the lean forward takes them from
# the model's rotary embedding, with its attention scaling); "dynamic" and "longrope"
# change them with the sequence's length.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys that change the arithmetic in some architecture, and the value that leaves it as
# Llama's; each architecture lists those it follows (`_FOLLOWS`).
_ARITHMETIC = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0,
               "attention_multiplier": None, "logits_scaling": 1.0,
               "attn_logit_softcapping": None, "final_logit_softcapping": None,
               "query_pre_attn_scalar": None, "use_sliding_window": False,
               "sliding_window": None, "use_qk_norm": False, "qk_layernorm": False,
               "partial_rotary_factor": 1.0, "logit_scale": None}
_FOLLOWS = {"mistral": {"sliding_window"}, "phi3": {"sliding_window"},
            "granite": {"embedding_multiplier", "residual_multiplier",
                        "attention_multiplier", "logits_scaling"}}


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

    def scale(self, head_dim: int) -> float:
        """The attention scores' scale."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return head_dim ** -0.5


def describe(config: Any) -> Arch:
    """The `Arch` of a model config (transformers' or config.json's fields as
    attributes); `Unsupported` where the lean forward cannot follow it exactly."""
    name = getattr(config, "model_type", None)
    if name not in ARCHITECTURES:
        raise Unsupported(f"model_type {name!r} is not one the lean forward runs "
                          f"({', '.join(ARCHITECTURES)})")
    _check_plain(config, name)
    _check_rope(config)
    _check_keys(config, name)
    if name == "granite":
        return Arch(name, embedding_multiplier=float(config.embedding_multiplier),
                    residual_multiplier=float(config.residual_multiplier),
                    attention_multiplier=float(config.attention_multiplier),
                    logits_scaling=float(config.logits_scaling))
    return Arch(name, qkv_bias=name == "qwen2", qk_norm=name == "qwen3",
                fused=name == "phi3",
                window=_window(config) if name in ("mistral", "phi3") else 0)


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
    if getattr(config, "hidden_act", None) != "silu":
        raise Unsupported(f"hidden_act {getattr(config, 'hidden_act', None)!r} (the lean "
                          f"forward runs silu)")
    if getattr(config, "mlp_bias", False):
        raise Unsupported("mlp_bias")
    if name != "qwen2" and getattr(config, "attention_bias", False):
        raise Unsupported("attention_bias")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise Unsupported("pretraining_tp")
    if getattr(config, "quantization_config", None) is not None:
        raise Unsupported("quantization_config (a quantized model)")


def _check_rope(config: Any) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise Unsupported(f"rope_parameters.rope_type {kind!r} (the lean forward runs "
                          f"{', '.join(ROPE_TYPES)})")
    if "rope_theta" not in rope:
        raise Unsupported("rope_parameters without rope_theta")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported("rope_parameters.partial_rotary_factor")


def _check_keys(config: Any, name: str) -> None:
    for key, neutral in _ARITHMETIC.items():
        if key in _FOLLOWS.get(name, ()):
            continue
        value = getattr(config, key, neutral)
        if value != neutral and not (key == "sliding_window" and _window_unused(config)):
            raise Unsupported(f"{key} {value!r} (the lean forward does not run it for "
                              f"{name})")


def _window_unused(config: Any) -> bool:
    """qwen2/qwen3 configs carry a `sliding_window` that only `use_sliding_window` turns
    on (then refused by its own key)."""
    return getattr(config, "use_sliding_window", None) is False
