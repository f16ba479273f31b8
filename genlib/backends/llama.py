"""A lean forward pass for Llama-architecture models, for one unpadded row (batch 1).
The architectures it runs differ from Llama's block in a few declared ways
(`genlib.backends.arch.Arch`: q/k biases, q/k norms, a sliding window, multipliers).

transformers' `LlamaForCausalLM.forward` spends most of a small model's decode step on
bookkeeping around the arithmetic: module calls, mask creation, config lookups, rotary
tables recomputed every step, cache objects. `LeanLlama` runs the same arithmetic in the
same order on the model's own weight tensors (copied only to fuse the q/k/v and the
gate/up products, which gives bit-identical values), with the rotary tables computed once
for every position and the KV cache preallocated, so a step is little more than its
matrix products (as llama2.c's and gpt-fast's forward functions are).

    lean = LeanLlama.from_model(hf_model)    # None when the model is not plain Llama
    cache = lean.new_cache(capacity)         # one generation's KV buffers
    logits = lean.prefill(input_ids, cache)  # (1, T) -> (1, vocab) float32
    logits = lean.step(token, cache)         # (1, 1) -> (1, vocab) float32

The weights are shared; each generation has its own `LeanCache`, so generations on one
model may interleave (a draft model that is the target itself, a generation started
while another one waits).

`_static_step` is the step written for torch.compile (genlib.backends.compiled compiles
it; genlib.backends.native runs the whole step as one C function instead): the KV
buffers are updated in place at a position held in a 0-d tensor and attention reads as
many cached tokens as that position says, a size the graph reads from the tensor, so one
graph serves every step. Neither uses torch.mm for its products: the logits differ in
the last bits, the tokens do not in the tests.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from genlib.backends import hugepages
from genlib.backends.arch import LAYER_TYPES, Arch, Unsupported, describe
from genlib.backends.gpt2 import gelu_new, gpt2_tensors, is_gpt2, plain_refusal
from genlib.backends.kernel import MLP_NORM, qkv_bias
from genlib.backends.kernel import QKV as _QKV

_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


SPLIT_BYTES = 1 << 20  # one-row products of weights this large run split across threads


def _row_splits(weight: torch.Tensor) -> int:
    """How many pieces a one-row product with `weight` (K, N) is split into: one per
    thread for float32 weights of at least SPLIT_BYTES on a CPU whose BLAS is MKL, 1
    (no split) otherwise. MKL runs a one-row product (an SGEMM with one column) on one
    thread whatever torch's thread count, reading the weight from memory at about a
    fifth of the machine's bandwidth; a batched SGEMM over equal slices of the output
    runs one slice per thread, and computes every output with the same dot product when
    each slice's width is a multiple of 4 (MKL takes another path for the remainder
    columns otherwise). `_Proj.of` checks that on the weight itself before using it
    (tests/test_lean.py checks the logits stay bit-identical)."""
    threads = torch.get_num_threads()
    if (threads < 2 or weight.device.type != "cpu" or weight.dtype != torch.float32
            or not torch.backends.mkl.is_available()
            or weight.numel() * weight.element_size() < SPLIT_BYTES):
        return 1
    n = weight.shape[1]
    return threads if n % threads == 0 and (n // threads) % 4 == 0 else 1


def _same_as_mm(w: torch.Tensor, split: torch.Tensor) -> bool:
    """Whether the split product gives torch.mm's bits on a random row (the order of a
    BLAS kernel's sums does not depend on the values, so one row tells)."""
    x = torch.randn(1, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    return torch.equal(_mm(x, _Proj(w, split)), torch.mm(x, w))


@dataclass(frozen=True)
class _Proj:
    """A projection's weight as `x @ w` takes it, (K, N), and, when one-row products
    with it are split across threads (`_row_splits`), the same storage as (pieces, K,
    N / pieces) views for a batched product; or, for stacked matrices whose one product
    would not give each block its own product's bits (`stacked`), the blocks' views,
    each multiplied on its own."""

    w: torch.Tensor
    split: torch.Tensor | None = None
    blocks: tuple[torch.Tensor, ...] = ()

    @classmethod
    def stacked(cls, w: torch.Tensor, sizes: list[int]) -> _Proj:
        """`w` (K, N): matrices stacked along N (q/k/v, gate/up), `sizes` their widths.
        One product where it gives every block the bits of the block's own product
        (transformers' separate projections) for the row counts probed; else one
        product a block. A BLAS kernel's order of sums depends on the shapes and the
        threads, not on the values, so a random input tells; on some CPUs two threads
        split one wide one-row product otherwise than its narrower parts."""
        blocks = tuple(w.split(sizes, dim=1))
        x = torch.randn(max(_PROBE_ROWS), w.shape[0],
                        generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
        same = all(torch.equal(torch.mm(x[:rows], w),
                               torch.cat([torch.mm(x[:rows], b) for b in blocks], 1))
                   for rows in _PROBE_ROWS)
        return cls.of(w) if same else cls(w, blocks=blocks)

    @classmethod
    def of(cls, w: torch.Tensor) -> _Proj:
        """`w` (K, N): the transpose of a contiguous (N, K) matrix, as nn.Linear holds it."""
        pieces = _row_splits(w)
        if pieces == 1 or not w.t().is_contiguous():
            return cls(w)
        k, n = w.shape
        split = w.t().view(pieces, n // pieces, k).transpose(1, 2)
        return cls(w, split) if _same_as_mm(w, split) else cls(w)


# The row counts `_Proj.stacked` checks: a step's one row, and prompts' several.
_PROBE_ROWS = (1, 2, 3, 8, 37, 128)


def _mm(x: torch.Tensor, proj: _Proj) -> torch.Tensor:
    """x (T, K) @ proj.w; a single row through the split views when there are some;
    block by block where the blocks must be multiplied on their own."""
    if proj.blocks:
        return torch.cat([torch.mm(x, block) for block in proj.blocks], 1)
    if proj.split is None or x.shape[0] != 1:
        return torch.mm(x, proj.w)
    pieces = proj.split.shape[0]
    return torch.bmm(x.expand(pieces, 1, x.shape[1]), proj.split).view(1, -1)


def _matvec(x: torch.Tensor, proj: _Proj) -> torch.Tensor:
    """x (1, K) @ proj.w (K, N) as a reduction along the weight's contiguous rows: under
    torch.compile this becomes one fused, vectorized, multi-threaded loop reading the
    weight once, where torch.mm's GEMV leaves most of the memory bandwidth unused."""
    return (proj.w.t() * x).sum(-1)[None]


Matmul = Callable[[torch.Tensor, _Proj], torch.Tensor]


@dataclass
class _Layer:
    """One decoder layer: its norm weights and its projections transposed for `x @ w`
    (views of the model's tensors, except q/k/v and gate/up concatenated into one product
    each)."""

    input_norm: torch.Tensor
    qkv: _Proj  # (hidden, (heads + 2 * kv_heads) * head_dim)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # per-head RMSNorm weights (head_dim,): qwen3
    k_norm: torch.Tensor | None
    o: _Proj
    post_norm: torch.Tensor  # the MLP's input norm (gemma's pre_feedforward_layernorm)
    gate_up: _Proj  # (hidden, 2 * intermediate)
    down: _Proj
    attn_out_norm: torch.Tensor | None = None  # gemma's norms on the sublayers' outputs
    mlp_out_norm: torch.Tensor | None = None
    # gpt2's: its LayerNorms' biases, and those of the o, fc (gate_up) and down products
    input_norm_bias: torch.Tensor | None = None
    post_norm_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass
class LeanCache:
    """One generation's KV cache over a LeanLlama: per layer, key and value buffers of
    `capacity` positions (1, kv_heads, capacity, head_dim), the first `length` filled;
    and the compiled step's inputs, the same tensors on every step (the position it
    writes, the token it reads)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    position: torch.Tensor  # 0-d long
    token: torch.Tensor  # (1, 1) long
    length: int = 0
    native: Any = None  # a NativeStep's pointers to these buffers: kernel._CacheView

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` cached tokens."""
        self.length = min(self.length, length)

    def copy_from(self, other: LeanCache) -> None:
        """Hold `other`'s tokens: its first `length` positions copied into these buffers
        (a beam taking over another's history, without new buffers). Only the filled
        positions are copied; this cache's capacity must hold them."""
        if other.length > self.capacity:
            raise ValueError(f"{other.length} tokens exceed the KV buffers' {self.capacity}")
        with torch.no_grad():
            for mine, theirs in zip(self.keys + self.values, other.keys + other.values):
                mine[:, :, :other.length].copy_(theirs[:, :, :other.length])
        self.length = other.length

    def clone(self) -> LeanCache:
        """A new cache of the same capacity holding this one's tokens."""
        def empty(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
            return [torch.empty_like(b) for b in buffers]

        copy = LeanCache(empty(self.keys), empty(self.values),
                         position=torch.zeros_like(self.position),
                         token=torch.zeros_like(self.token))
        copy.copy_from(self)
        return copy


def config_refusal(config: Any) -> str | None:
    """Why the lean forward cannot run a model config (transformers' or config.json's
    fields as attributes) exactly, in one line naming the key; None when it can."""
    if config is None:
        return "no model config"
    try:
        describe(config)
    except Unsupported as error:
        return str(error)
    return None


def eligible_config(config: Any) -> bool:
    """True when the lean forward runs a model config exactly (`config_refusal`)."""
    return config_refusal(config) is None


def refusal(model: Any) -> str | None:
    """Why the lean forward cannot run `model` exactly (one line); None when it can."""
    why = config_refusal(getattr(model, "config", None))
    if why is not None:
        return why
    if is_gpt2(model):
        return plain_refusal(model)
    inner = decoder(model)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "not a decoder-only model with layers and an lm_head"
    return None if _plain_layers(model) else "projections that are not plain float Linear layers"


def decoder(model: Any) -> Any:
    """The decoder whose layers the lean forward runs: `model.model`, or a
    vision-language model's `model.model.language_model` (gemma3's)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", inner)


def text_config(config: Any) -> Any:
    """The config of that decoder (a vision-language model's text_config)."""
    if getattr(config, "model_type", None) == "gemma3":
        return config.text_config
    return config


def eligible(model: Any) -> bool:
    """True when the lean forward runs `model` exactly (`refusal`)."""
    return refusal(model) is None


_ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")


def _plain_layers(model: Any) -> bool:
    inner = decoder(model)
    # Every projection must be a plain Linear (bitsandbytes and friends subclass it but
    # keep packed weights); the o/gate/up/down projections must have no bias.
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        named = [(n, getattr(attn, n)) for n in _ATTENTION if hasattr(attn, n)] + \
            [(n, getattr(mlp, n)) for n in _MLP if hasattr(mlp, n)]
        for name, proj in named:
            if type(proj) is not torch.nn.Linear or proj.weight.dtype != model.lm_head.weight.dtype:
                return False
            if proj.bias is not None and name not in _ATTENTION[:3]:
                return False
    return type(model.lm_head) is torch.nn.Linear and model.lm_head.bias is None


def _rope_of(rotary: Any, kind: str = "") -> tuple[torch.Tensor, float]:
    """A rotary embedding's frequencies and attention scaling (gemma3's of one layer
    type: `kind` "full_attention_" or "sliding_attention_")."""
    return (getattr(rotary, kind + "inv_freq"),
            float(getattr(rotary, kind + "attention_scaling", 1.0)))


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """transformers' repeat_kv: each KV head's rows repeated for its `group` q heads."""
    if group == 1:
        return x
    batch, heads, length, dim = x.shape
    return x[:, :, None].expand(batch, heads, group, length, dim).reshape(
        batch, heads * group, length, dim)


def split_fused(tensors: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """phi3's fused `qkv_proj` and `gate_up_proj` weights as Llama's q/k/v and gate/up
    (views: the lean forward stacks them again into its own buffer)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    out = dict(tensors)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        qkv = out.pop(prefix + "self_attn.qkv_proj.weight")
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        for name, part in zip(_QKV, qkv.split(sizes)):
            out[f"{prefix}{name}.weight"] = part
        gate, up = out.pop(prefix + "mlp.gate_up_proj.weight").chunk(2)
        out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
    return out


class LeanLlama:
    """Llama's forward for one row over preallocated KV caches, one per generation
    (`new_cache`; see the module doc)."""

    def __init__(self, config: Any, tensors: Mapping[str, torch.Tensor],
                 inv_freq: torch.Tensor | None, rope_scaling: float = 1.0,
                 local_rope: tuple[torch.Tensor, float] | None = None) -> None:
        """`tensors` by their state-dict names (`model.layers.0.self_attn.q_proj.weight`,
        ...; `lm_head.weight` may be absent when tied to the embeddings), `inv_freq` the
        rotary frequencies as the model computes them and `rope_scaling` the factor on
        its cos/sin tables (its rotary embedding's `attention_scaling`: yarn's);
        `local_rope` the same two for gemma3's sliding layers. Learned positions
        (gpt2's) take no rope: `inv_freq` None, and `model.embed_positions.weight`."""
        self.arch: Arch = describe(config)
        config = text_config(config)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.arch.scale(self.head_dim)
        self.eps = config.layer_norm_epsilon if self.arch.layernorm else config.rms_norm_eps
        self.max_positions = config.max_position_embeddings
        self.tensors = tensors
        self.embed = tensors["model.embed_tokens.weight"]
        self._norms: dict[str, torch.Tensor] = {}
        self.norm = self.norm_weight("model.norm.weight")
        self.norm_bias = tensors.get("model.norm.bias")  # gpt2's LayerNorm
        self.position_embed = tensors.get("model.embed_positions.weight")  # gpt2's wpe
        self.head_name = "lm_head.weight" if "lm_head.weight" in tensors else \
            "model.embed_tokens.weight"
        self.vocab = tensors[self.head_name].shape[0]
        self.num_layers = config.num_hidden_layers
        self.tied = bool(getattr(config, "tie_word_embeddings", False))  # lm_head = embeddings
        self.intermediate = tensors["model.layers.0.mlp.down_proj.weight"].shape[1]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.weights_file: Path | None = None  # set by genlib.models.quickload: the file mapped
        self.stored: Any = None  # genlib.models.qformat.Stored: a quantized checkpoint's codes
        self.cos: torch.Tensor | None = None  # no tables for learned positions
        self.sin: torch.Tensor | None = None
        if inv_freq is not None:
            self.cos, self.sin = self._rotary_tables(inv_freq, rope_scaling)
        self.local_cos, self.local_sin = (self.cos, self.sin) if local_rope is None else \
            self._rotary_tables(*local_rope)
        self._embed_scale = None if self.arch.embed_scale is None else \
            torch.tensor(self.arch.embed_scale).to(self.dtype)  # as gemma's embeddings do
        self._ones = torch.ones(1, max(self.arch.window, 1), dtype=torch.bool,
                                device=self.device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights one step of the torch forward reads, at its dtype (a
        quantized checkpoint's dequantized; genlib.backends.sizes: tied matrices once, the
        embedding tables only where one is the output matrix); counted from the shapes,
        so nothing is read or made."""
        shapes = dict(self.stored.shapes) if self.stored is not None else \
            {name: tensor.shape for name, tensor in self.tensors.items()}
        for table in ("model.embed_tokens.weight", "model.embed_positions.weight"):
            if table != self.head_name:
                shapes.pop(table, None)
        return sum(math.prod(shape) for shape in shapes.values()) * self.embed.element_size()

    @functools.cached_property
    def lm_head(self) -> _Proj:
        """The output projection as `x @ w` takes it; made on first use, as `layers` is."""
        return _Proj.of(self.tensors[self.head_name].t())

    @functools.cached_property
    def layers(self) -> list[_Layer]:
        """The decoder layers of the torch forward, made on its first use: the native
        kernel packs its own matrices from `tensors` and never needs these (the fused
        q/k/v and gate/up matrices are copies)."""
        if self.arch.biases:  # gpt2: its own fused products, as it multiplies by them
            return [self._gpt2_layer(self.tensors, f"model.layers.{i}.")
                    for i in range(self.num_layers)]
        fused = self._fused_weights(self.tensors, self.num_layers)
        return [self._layer(self.tensors, f"model.layers.{i}.", qkv, gate_up)
                for i, (qkv, gate_up) in enumerate(fused)]

    @classmethod
    def from_model(cls, model: Any) -> LeanLlama | None:
        """A LeanLlama over a transformers model's weights, or None when it is not
        eligible."""
        if not eligible(model):
            return None
        if is_gpt2(model):  # learned positions: no rope
            return cls(model.config, gpt2_tensors(model), None)
        inner, config = decoder(model), text_config(model.config)
        tensors = {"model." + name: p.detach() for name, p in inner.named_parameters()}
        tensors["lm_head.weight"] = model.lm_head.weight.detach()
        if describe(config).fused:
            tensors = split_fused(tensors, config)
        if describe(config).local_rope:  # gemma3: one rope per layer type it has
            ropes = {kind: _rope_of(inner.rotary_emb, kind + "_") for kind in LAYER_TYPES
                     if hasattr(inner.rotary_emb, kind + "_inv_freq")}
            full = ropes.get("full_attention") or ropes["sliding_attention"]
            return cls(model.config, tensors, *full,
                       local_rope=ropes.get("sliding_attention", full))
        return cls(model.config, tensors, *_rope_of(inner.rotary_emb))

    def norm_weight(self, name: str) -> torch.Tensor:
        """A norm's weight as the forward multiplies by it: the tensor itself, or gemma's
        (1 + weight) in float32 (as Gemma2RMSNorm computes it), made once, so the lean
        forward and the kernel share it."""
        if not self.arch.sandwich:
            return self.tensors[name]
        if name not in self._norms:
            self._norms[name] = 1.0 + self.tensors[name].float()
        return self._norms[name]

    @staticmethod
    @torch.no_grad()
    def _fused_weights(tensors: Mapping[str, torch.Tensor], layers: int
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the q/k/v weights stacked into one (rows, hidden) matrix and the
        gate/up weights into another: one product instead of three (two), with the same
        dot products, so the same values where the BLAS kernel sums them in the same
        order (`_Proj.stacked` checks, and multiplies block by block otherwise;
        tests/test_lean.py checks the logits are bit-identical). All of them are written
        into one buffer of 2 MiB pages (genlib.backends.hugepages), which the decode
        step streams faster."""
        groups = [[tensors[f"model.layers.{i}.{name}.weight"] for name in names]
                  for i in range(layers) for names in (_QKV, _GATE_UP)]
        sizes = [sum(w.numel() for w in group) for group in groups]
        first = groups[0][0]
        buffer = hugepages.empty(sum(sizes), first.dtype, first.device)
        matrices, start = [], 0
        for group, size in zip(groups, sizes):
            matrix = buffer[start:start + size].view(-1, group[0].shape[1])
            matrices.append(torch.cat(group, out=matrix))
            start += size
        return list(zip(matrices[0::2], matrices[1::2]))

    @torch.no_grad()
    def _layer(self, tensors: Mapping[str, torch.Tensor], prefix: str, qkv: torch.Tensor,
               gate_up: torch.Tensor) -> _Layer:
        """One layer over its weights, with its fused q/k/v and gate/up matrices
        (`_fused_weights`)."""
        def weight(name: str) -> torch.Tensor:
            return tensors[prefix + name + ".weight"]

        def norm(name: str) -> torch.Tensor | None:
            present = prefix + name + ".weight" in tensors
            return self.norm_weight(prefix + name + ".weight") if present else None

        def widths(names: tuple[str, ...]) -> list[int]:
            return [weight(name).shape[0] for name in names]

        sandwich = self.arch.sandwich
        return _Layer(input_norm=norm("input_layernorm"),
                      qkv=_Proj.stacked(qkv.t(), widths(_QKV)),
                      qkv_bias=qkv_bias(tensors, prefix),
                      q_norm=norm("self_attn.q_norm"), k_norm=norm("self_attn.k_norm"),
                      o=_Proj.of(weight("self_attn.o_proj").t()),
                      post_norm=norm(MLP_NORM[sandwich]),
                      gate_up=_Proj.stacked(gate_up.t(), widths(_GATE_UP)),
                      down=_Proj.of(weight("mlp.down_proj").t()),
                      attn_out_norm=norm("post_attention_layernorm") if sandwich else None,
                      mlp_out_norm=norm("post_feedforward_layernorm") if sandwich else None)

    @torch.no_grad()
    def _gpt2_layer(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> _Layer:
        """One gpt2 layer over its Conv1D weights as stored, [in, out] (`x @ w` takes
        them so: transformers' addmm on the same tensors), and its biases
        (genlib.backends.gpt2 names them)."""
        def stored(name: str) -> _Proj:
            return _Proj(tensors[prefix + name + ".weight"].t())

        def bias(name: str) -> torch.Tensor:
            return tensors[prefix + name + ".bias"]

        return _Layer(input_norm=tensors[prefix + "input_layernorm.weight"],
                      qkv=stored("self_attn.qkv_proj"), qkv_bias=bias("self_attn.qkv_proj"),
                      q_norm=None, k_norm=None, o=stored("self_attn.o_proj"),
                      post_norm=tensors[prefix + "post_attention_layernorm.weight"],
                      gate_up=stored("mlp.up_proj"), down=stored("mlp.down_proj"),
                      input_norm_bias=bias("input_layernorm"),
                      post_norm_bias=bias("post_attention_layernorm"),
                      o_bias=bias("self_attn.o_proj"), up_bias=bias("mlp.up_proj"),
                      down_bias=bias("mlp.down_proj"))

    def _rotary_tables(self, inv_freq: torch.Tensor, scaling: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        # As LlamaRotaryEmbedding.forward computes them (float32, times the rope's
        # attention scaling, then the model's dtype), once for every position instead of
        # once per step. The sine table carries rotate_half's sign, so
        # rotate_half(x) * sin == roll(x, half) * signed_sin.
        positions = torch.arange(self.max_positions, device=self.device).float()
        freqs = positions[:, None] * inv_freq.to(device=self.device, dtype=torch.float)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.device)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        return cos.to(self.dtype), sin.to(self.dtype) * sign.to(self.dtype)

    # --- KV cache ---------------------------------------------------------------------

    def new_cache(self, capacity: int | None = None, spare: int = 0) -> LeanCache:
        """An empty cache for one generation of up to `capacity` tokens (default and
        at most: the model's positions), and `spare` slots more for the alternatives
        `candidates` holds after the last token. Slots past `length` are never read, so
        the buffers are not cleared."""
        capacity = min(capacity or self.max_positions, self.max_positions) + spare
        shape = (1, self.kv_heads, capacity, self.head_dim)

        def buffers() -> list[torch.Tensor]:
            return [torch.empty(shape, dtype=self.dtype, device=self.device)
                    for _ in range(self.num_layers)]

        return LeanCache(buffers(), buffers(),
                         position=torch.zeros((), dtype=torch.long, device=self.device),
                         token=torch.zeros((1, 1), dtype=torch.long, device=self.device))

    # --- Forward (rows are positions: x is (tokens, hidden)) ---------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # LlamaRMSNorm: in float32, then back to the input dtype before the weight;
        # gemma's: times its float32 (1 + weight) (`norm_weight`), then back.
        h = x if x.dtype == torch.float32 else x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.arch.sandwich:
            return (h * weight).to(x.dtype)
        return weight * (h if x.dtype == torch.float32 else h.to(x.dtype))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        """A block's norm: gpt2's LayerNorm (nn.LayerNorm's arithmetic), else RMSNorm."""
        if self.arch.layernorm:
            return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
        return self._rms_norm(x, weight)

    @staticmethod
    def _biased(x: torch.Tensor, proj: _Proj, bias: torch.Tensor | None,
                mm: Matmul = _mm) -> torch.Tensor:
        """x @ proj.w, plus gpt2's bias as its Conv1D adds it: in the product (addmm)."""
        return mm(x, proj) if bias is None else torch.addmm(bias, x, proj.w)

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor | None,
             sin: torch.Tensor | None, mm: Matmul = _mm
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (1, heads, T, d), k and v (1, kv_heads, T, d), rotary applied to q and k
        (no tables, `cos` None: learned positions, gpt2's)."""
        t = x.shape[0]
        h = self._norm(x, layer.input_norm, layer.input_norm_bias)
        if self.arch.biases:  # gpt2: c_attn's addmm
            qkv = self._biased(h, layer.qkv, layer.qkv_bias)
        else:
            qkv = mm(h, layer.qkv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias  # as nn.Linear adds it: after the product
        qkv = qkv.view(t, -1, self.head_dim)
        rotary = self.heads + self.kv_heads
        qk = qkv[:, :rotary]
        if layer.q_norm is not None:  # qwen3: each head's q and k RMS-normed, before rope
            qk = torch.cat([self._rms_norm(qk[:, :self.heads], layer.q_norm),
                            self._rms_norm(qk[:, self.heads:], layer.k_norm)], 1)
        # apply_rotary_pos_emb on q and k at once: x * cos + rotate_half(x) * sin.
        if cos is not None:
            qk = (qk * cos) + (qk.roll(self.head_dim // 2, -1) * sin)
        q = qk[:, :self.heads].transpose(0, 1)[None]
        k = qk[:, self.heads:].transpose(0, 1)[None]
        return q, k, qkv[:, rotary:].transpose(0, 1)[None]

    def _mlp(self, layer: _Layer, x: torch.Tensor, mm: Matmul = _mm) -> torch.Tensor:
        if not self.arch.gated:
            return self._plain_mlp(layer, x)
        gate, up = mm(self._rms_norm(x, layer.post_norm), layer.gate_up).chunk(2, -1)
        # silu on a strided view takes another (scalar) path for the row tails: make the
        # gate contiguous, as transformers' separate gate_proj output is; phi3's is a
        # view of its fused product there too, and up * silu(gate) its order.
        if self.arch.fused:
            return self._residual(x, mm(up * F.silu(gate), layer.down))
        if self.arch.gelu:  # gemma's GeGLU: transformers' gelu_pytorch_tanh
            gated = F.gelu(gate.contiguous(), approximate="tanh") * up
            return self._residual(x, mm(gated, layer.down), layer.mlp_out_norm)
        return self._residual(x, mm(F.silu(gate.contiguous()) * up, layer.down))

    def _plain_mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """gpt2's MLP: c_proj(act(c_fc(ln_2(x)))), added to x."""
        h = self._biased(self._norm(x, layer.post_norm, layer.post_norm_bias), layer.gate_up,
                         layer.up_bias)
        kind = self.arch.activation
        h = gelu_new(h) if kind == "gelu_new" else \
            F.gelu(h, approximate="tanh" if kind == "gelu_tanh" else "none")
        return self._residual(x, self._biased(h, layer.down, layer.down_bias))

    def _residual(self, x: torch.Tensor, branch: torch.Tensor,
                  out_norm: torch.Tensor | None = None) -> torch.Tensor:
        """x plus a sublayer's output, RMS-normed first as gemma's are (`out_norm`),
        scaled as granite scales it."""
        if out_norm is not None:
            branch = self._rms_norm(branch, out_norm)
        multiplier = self.arch.residual_multiplier
        return x + branch if multiplier == 1.0 else x + branch * multiplier

    def _attend(self, layer: _Layer, keys: torch.Tensor, values: torch.Tensor,
                x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, window: int) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self._qkv(layer, x, cos, sin)
        end = start + t
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        # Causal over the prompt; several tokens after a cached prefix (speculative
        # verify), or past a sliding window, take an explicit mask. One token past the
        # window reads the window's last keys only.
        first = max(0, end - window) if t == 1 and window else 0
        attend = self._eager if self.arch.eager else self._sdpa
        out = attend(q, keys[:, :, first:], values[:, :, first:], end - first,
                     mask=mask, causal=t > 1 and mask is None)
        return self._residual(x, self._biased(out[0].transpose(0, 1).reshape(t, -1),
                                              layer.o, layer.o_bias),
                              layer.attn_out_norm)

    def _eager(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, end: int,
               mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """Attention as transformers' eager_attention_forward runs it (gemma2's, whose
        SDPA path has no soft-cap): the scores scaled, soft-capped, masked, a float32
        softmax back in the model's dtype, times the values."""
        group = self.heads // self.kv_heads
        keys, values = _repeat_kv(keys[:, :, :end], group), _repeat_kv(values[:, :, :end], group)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scale
        cap = self.arch.attn_softcap
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        if causal:
            t = q.shape[2]
            mask = torch.ones(t, end, dtype=torch.bool, device=q.device).tril(end - t)
        if mask is not None:  # transformers adds the dtype's min where a slot is hidden
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              end: int | torch.SymInt, mask: torch.Tensor | None = None,
              causal: bool = False) -> torch.Tensor:
        # SDPA over the first `end` cached tokens, with grouped heads, as transformers'
        # sdpa path runs it: under a mask without SDPA's grouped heads, one query's heads
        # of a KV head taken as its rows, several queries' KV heads repeated.
        keys, values = keys[:, :, :end], values[:, :, :end]
        group = self.heads // self.kv_heads
        if mask is None or group == 1:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  is_causal=causal, scale=self.scale,
                                                  enable_gqa=True)
        if q.shape[2] == 1:
            packed = q.reshape(1, self.kv_heads, group, self.head_dim)
            return F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask,
                                                  scale=self.scale).view(q.shape)
        return F.scaled_dot_product_attention(q, keys.repeat_interleave(group, 1),
                                              values.repeat_interleave(group, 1),
                                              attn_mask=mask, scale=self.scale)

    def _logits(self, x: torch.Tensor, mm: Matmul = _mm) -> torch.Tensor:
        logits = mm(self._final_hidden(x), self.lm_head)
        if self.arch.logits_scaling != 1.0:
            logits = logits / self.arch.logits_scaling  # granite's
        cap = self.arch.final_softcap
        if cap is not None:  # gemma's
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _embed(self, ids: torch.Tensor, start: int, one_position: bool = False
               ) -> torch.Tensor:
        """The tokens' embeddings, at positions `start`.. (all at `start`: candidates),
        plus gpt2's learned position embeddings there."""
        x = F.embedding(ids, self.embed)
        if self.position_embed is not None:
            count = 1 if one_position else ids.shape[0]
            positions = torch.arange(start, start + count, device=self.device)
            return x + F.embedding(positions, self.position_embed)
        if self._embed_scale is not None:
            return x * self._embed_scale  # gemma's
        multiplier = self.arch.embedding_multiplier
        return x if multiplier == 1.0 else x * multiplier  # granite's

    def _mask(self, start: int, t: int, window: int) -> torch.Tensor | None:
        """Which cached slots each of t tokens after `start` sees, where causal
        attention from position 0 does not say it (as transformers masks): None for a
        prompt (t > 1, start 0) shorter than the window, or one token before it. One
        token at the window or past it reads the window's last keys alone, under a mask
        that keeps them all (as transformers' sliding cache and mask give it: the same
        bits)."""
        end = start + t
        if t == 1:
            return self._ones[:, :window] if window and end >= window else None
        if start == 0 and not (window and end >= window):
            return None
        slots = torch.arange(end, device=self.device)[None, :]
        positions = start + torch.arange(t, device=self.device)[:, None]
        mask = slots <= positions  # token i sees the cached prefix and tokens 0..i
        return mask & (slots > positions - window) if window else mask

    def _forward(self, input_ids: torch.Tensor, cache: LeanCache, all_logits: bool = False
                 ) -> torch.Tensor:
        start, t = cache.length, input_ids.shape[1]
        if start + t > cache.capacity:
            raise ValueError(f"{start + t} tokens exceed the KV buffers' {cache.capacity}")
        x, _ = self._through_layers(self._embed(input_ids[0], start), cache, start,
                                    lambda window: self._mask(start, t, window))
        cache.length = start + t
        return self._logits(x if all_logits else x[-1:])

    def _through_layers(self, x: torch.Tensor, cache: LeanCache, start: int,
                        mask_of: Callable[[int], torch.Tensor | None],
                        keep: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, Any]]:
        """x (T, hidden), the embedded tokens at positions `start`.., through every
        layer, each with its window's mask (`mask_of(window)`, made once a window) and
        its rope tables; the output, and the outputs of the layers numbered in `keep`
        (1 the first layer's)."""
        t = x.shape[0]
        masks: dict[int, torch.Tensor | None] = {}
        kept = {}
        for number, (layer, keys, values) in enumerate(
                zip(self.layers, cache.keys, cache.values), start=1):
            window = self.arch.window_of(number - 1)
            if window not in masks:
                masks[window] = mask_of(window)
            cos, sin = self._rope_at(number - 1, start, t)
            x = self._mlp(layer, self._attend(layer, keys, values, x, start, cos, sin,
                                              masks[window], window))
            if number in keep:
                kept[number] = x
        return x, kept

    def _rope_at(self, layer: int, start: int, t: int
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s rope tables at positions start..start + t - 1, (t, 1, d)
        each; None for learned positions."""
        cos, sin = self.rope_tables(layer)
        if cos is None or sin is None:
            return None, None
        return cos[start:start + t, None], sin[start:start + t, None]

    def rope_tables(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s rope tables: gemma3's sliding layers have their own."""
        if self.arch.local_rope and layer not in self.arch.full_layers:
            return self.local_cos, self.local_sin
        return self.cos, self.sin

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: LeanCache) -> torch.Tensor | None:
        """Run one prompt (1, T) from position 0 into `cache` (emptied first); the last
        position's logits (1, vocab) float32, None for an empty prompt (T = 0)."""
        if input_ids.shape[0] != 1:
            raise ValueError("the lean forward takes one row (batch 1)")
        cache.length = 0
        return self._forward(input_ids, cache) if input_ids.shape[1] else None

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, cache: LeanCache) -> torch.Tensor:
        """Feed several tokens (1, k) after the cached ones (speculative verification);
        the logits of every one of them, (1, k, vocab) float32."""
        return self._forward(tokens, cache, all_logits=True)[None]

    @torch.inference_mode()
    def step(self, token: torch.Tensor, cache: LeanCache) -> torch.Tensor:
        """Feed one token (1, 1) after the cached ones; its logits (1, vocab) float32."""
        return self._forward(token, cache)

    # --- Hidden states (contrastive search, DoLa) -------------------------------------

    def _final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output after the final norm: transformers'
        `hidden_states[-1]`, the input of lm_head."""
        return self._norm(x, self.norm, self.norm_bias)

    @torch.inference_mode()
    def forward_states(self, tokens: torch.Tensor, cache: LeanCache,
                       layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens (1, T) after the cached ones (from position 0 after `crop(0)`),
        as `extend` does; the last position's logits (1, vocab) float32 and, for each of
        `layers`, every position's hidden state (len(layers), T, hidden), numbered as
        transformers' `output_hidden_states` numbers them: 0 the embeddings, j the
        output of layer j, `num_layers` the last layer's after the final norm. The plain
        `step` stays as it is: this is a second loop over the same pieces."""
        start, t = cache.length, tokens.shape[1]
        if start + t > cache.capacity:
            raise ValueError(f"{start + t} tokens exceed the KV buffers' {cache.capacity}")
        embedded = self._embed(tokens[0], start)
        x, kept = self._through_layers(embedded, cache, start,
                                       lambda window: self._mask(start, t, window), layers)
        if 0 in layers:
            kept[0] = embedded
        cache.length = start + t
        if self.num_layers in layers:
            kept[self.num_layers] = self._final_hidden(x)
        return self._logits(x[-1:]), torch.stack([kept[j] for j in layers])

    def early_exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head applied to an earlier layer's hidden states (..., hidden) as DoLa's
        reference code applies it, without the final norm; float32."""
        return torch.matmul(hidden, self.lm_head.w).float()

    @torch.inference_mode()
    def candidates(self, tokens: torch.Tensor, cache: LeanCache
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """k alternative next tokens (k,), each one step after the cached ones, in one
        forward: all at the next position, each reading the cache and itself alone;
        their logits (k, vocab) float32 and final hidden states (k, hidden). Their keys
        and values sit in the k slots after the cache until `keep_candidate` keeps one;
        the cache's length is unchanged."""
        start, k = cache.length, tokens.shape[0]
        if start + k > cache.capacity:
            raise ValueError(f"{start + k} tokens exceed the KV buffers' {cache.capacity}")
        x = self._embed(tokens, start, one_position=True)
        x = self._candidate_layers(x, cache, start)
        return self._logits(x), self._final_hidden(x)

    def _candidate_layers(self, x: torch.Tensor, cache: LeanCache, start: int
                          ) -> torch.Tensor:
        """k candidates (k, hidden), all at position `start`, through every layer."""
        k = x.shape[0]
        for i, (layer, keys, values) in enumerate(zip(self.layers, cache.keys, cache.values)):
            window = self.arch.window_of(i)
            cos, sin = self._rope_at(i, start, 1)
            x = self._mlp(layer, self._attend(layer, keys, values, x, start, cos, sin,
                                              self._candidate_mask(start, k, window), window))
        return x

    def _candidate_mask(self, start: int, k: int, window: int) -> torch.Tensor:
        """Candidate i (at position `start`) sees the cached slots before it (the last
        `window` of them past a sliding window) and its own slot `start + i`."""
        slots = torch.arange(start + k, device=self.device)[None, :]
        own = start + torch.arange(k, device=self.device)[:, None]
        context = slots < start
        if window:
            context = context & (slots > start - window)
        return context | (slots == own)

    @torch.no_grad()
    def keep_candidate(self, cache: LeanCache, index: int) -> None:
        """Keep candidate `index` of the last `candidates` call: its keys and values move
        to the next slot, and the cache holds one more token."""
        start = cache.length
        if index:
            for buffer in cache.keys + cache.values:
                buffer[:, :, start].copy_(buffer[:, :, start + index])
        cache.length = start + 1

    # --- Compiled step ----------------------------------------------------------------

    def _static_step(self, token: torch.Tensor, position: torch.Tensor,
                     keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        # The cache's KV buffers come as arguments, so DirectCompiled passes the current
        # ones. Every shape is fixed but attention's: SDPA reads the `position + 1`
        # cached tokens, a size read from the tensor inside the graph (unbacked in torch
        # 2.11, hinted in 2.13; either way one graph serves every position, called
        # without its guards by DirectCompiled), as `_attend` does, and as transformers
        # does: a mask over the whole buffer instead would change bfloat16's sums. The
        # step runs after a first token (`compiled.lean_compiled_step`), so at least two are read:
        # CUDA's SDPA picks its kernel by whether the length is 1, a guard the graph
        # cannot hold on an unbacked size unless that bound is known.
        index = position.view(1)
        length = position.item() + 1
        torch._check(length >= 2)
        torch._check(length <= keys[0].shape[2])
        cos = self.cos.index_select(0, index)[:, None]
        sin = self.sin.index_select(0, index)[:, None]
        x = self._embed(token[0], 0)  # the compiled step runs no learned positions
        for layer, layer_keys, layer_values in zip(self.layers, keys, values):
            q, k, v = self._qkv(layer, x, cos, sin, _matvec)
            layer_keys.index_copy_(2, index, k)
            layer_values.index_copy_(2, index, v)
            out = self._sdpa(q, layer_keys, layer_values, length)
            x = self._residual(x, _matvec(out.view(1, -1), layer.o))
            x = self._mlp(layer, x, _matvec)
        return self._logits(x, _matvec)

