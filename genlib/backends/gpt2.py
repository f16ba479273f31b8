"""GPT-2's weights (transformers' GPT2LMHeadModel) under the names the lean forward and
the native kernel read a Llama's by (`genlib.backends.llama`, `genlib.backends.kernel`).

GPT-2's projections are Conv1D layers, whose weights are stored [in, out], the transpose
of nn.Linear's: each is given here as a transposed view (out, in), no copy, and its bias
beside it. The fused q/k/v product (`c_attn`) is given whole (`self_attn.qkv_proj`, which
the lean forward multiplies by as transformers does) and split into q, k and v views
(which the kernel packs, stacked again). The MLP has no gate: `c_fc` is `mlp.up_proj`.

    tensors = gpt2_tensors(model)   # {"model.layers.0.self_attn.q_proj.weight": ..., ...}
"""

from __future__ import annotations

import math
from typing import Any

import torch

# GPT-2's module names, and the Llama names they go by here.
_NORMS = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
_PROJECTIONS = {"attn.c_attn": "self_attn.qkv_proj", "attn.c_proj": "self_attn.o_proj",
                "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def is_gpt2(model: Any) -> bool:
    """Whether `model` is a GPT-2 language model as transformers builds it."""
    return getattr(getattr(model, "config", None), "model_type", None) == "gpt2"


def plain_refusal(model: Any) -> str | None:
    """Why a gpt2 model's layers are not ones the lean forward reads (one line); None
    when every projection is a plain float Conv1D with a bias and the lm_head a Linear
    without one."""
    from transformers.pytorch_utils import Conv1D

    inner = getattr(model, "transformer", None)
    if inner is None or not hasattr(inner, "h") or not hasattr(model, "lm_head"):
        return "not a GPT-2 language model with layers and an lm_head"
    dtype = model.lm_head.weight.dtype
    for block in inner.h:
        for name in _PROJECTIONS:
            proj = block.get_submodule(name)
            if type(proj) is not Conv1D or proj.weight.dtype != dtype or proj.bias is None:
                return "projections that are not plain float Conv1D layers with biases"
    if type(model.lm_head) is not torch.nn.Linear or model.lm_head.bias is not None:
        return "an lm_head that is not a plain Linear layer without a bias"
    return None


def gpt2_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights by Llama's state-dict names (the module doc), views of its own
    tensors: `model.embed_tokens`, `model.embed_positions` (wpe), per layer its norms'
    weights and biases, its projections' weights (out, in) and biases, `model.norm`
    (ln_f) and `lm_head`."""
    inner = model.transformer
    out = {"model.embed_tokens.weight": inner.wte.weight.detach(),
           "model.embed_positions.weight": inner.wpe.weight.detach(),
           "model.norm.weight": inner.ln_f.weight.detach(),
           "model.norm.bias": inner.ln_f.bias.detach(),
           "lm_head.weight": model.lm_head.weight.detach()}
    for i, block in enumerate(inner.h):
        prefix = f"model.layers.{i}."
        for theirs, ours in _NORMS.items():
            norm = block.get_submodule(theirs)
            out[f"{prefix}{ours}.weight"] = norm.weight.detach()
            out[f"{prefix}{ours}.bias"] = norm.bias.detach()
        for theirs, ours in _PROJECTIONS.items():
            proj = block.get_submodule(theirs)
            out[f"{prefix}{ours}.weight"] = proj.weight.detach().t()  # [in, out] stored
            out[f"{prefix}{ours}.bias"] = proj.bias.detach()
        hidden = inner.wte.weight.shape[1]
        qkv, bias = (out[f"{prefix}self_attn.qkv_proj.{kind}"] for kind in ("weight", "bias"))
        for name, weight, part in zip(_QKV, qkv.split(hidden), bias.split(hidden)):
            out[f"{prefix}{name}.weight"], out[f"{prefix}{name}.bias"] = weight, part
    return out


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """gelu's tanh approximation as transformers' NewGELUActivation writes it out (op
    for op, so the same bits): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
                                       (x + 0.044715 * torch.pow(x, 3.0))))
