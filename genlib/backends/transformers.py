"""The transformers backend: the model's own forward over a growing (dynamic) KV cache.

It runs every model transformers runs (any architecture, quantized, any device), any
number of left-padded rows, and every operation: the reference the other backends are
tested against, and the one beam search and batches of several rows take where no
faster backend can (seed notes 003/004).

Everything that can be decided once (padding, whether the model accepts
`logits_to_keep`, the name its forward takes the cache by) is decided at prefill or once
per model class, not per step.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from genlib.backends.base import Backend, Capabilities
from genlib.backends.fit import common_refusal

if TYPE_CHECKING:
    from genlib.backends.fit import Request
    from genlib.models.info import LoadedModel


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), rows right-aligned so every row's last token is last."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def accepts_logits_to_keep(model: Any) -> bool:
    return _forward_takes_logits_to_keep(type(model))


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    # Signature inspection costs ~50 us: do it once per model class, not per call.
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """`cache` as the model's forward takes it (see `cache_keyword`)."""
    return {cache_keyword(model): cache}


def cache_keyword(model: Any) -> str:
    """The forward's keyword for its KV cache: `cache` from transformers 5.24, where
    `past_key_values` still works but warns on every call; `past_key_values` before."""
    return _cache_keyword(type(model))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The cache a forward returned (`cache` from transformers 5.24, `past_key_values`
    before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


class TransformersBackend(Backend):
    """transformers' forward over a dynamic cache. `attention_mask` and `positions` are
    None while no row is padded: the model then derives positions from the cache
    length, as it does for a single prompt."""

    name = "transformers"
    capabilities = Capabilities(rows=None, reorder=True, extend=True, crop=True)

    @classmethod
    def supports(cls, lm: LoadedModel, request: Request) -> str | None:
        return common_refusal(cls.name, lm, request)

    @classmethod
    def picked(cls, lm: LoadedModel, request: Request) -> str:
        if lm.quantize != "none":
            return "a bitsandbytes model runs on transformers' forward"
        return "transformers' forward"

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        lm.load_model_now()  # a quick-loaded model's transformers model, before any clock
        self.model = lm.model
        self.cache: Any = None
        self.attention_mask: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # (rows,) position id of the next token

    @torch.inference_mode()
    def _prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor | None:
        self.cache = new_cache(self.model)
        if len(rows) == 1 and len(rows[0]) == 0:
            self.attention_mask = self.positions = None
            self.length = 0
            return None
        input_ids, mask = left_pad(rows, self.lm.pad_id, self.lm.device)
        return self.prefill_ids(input_ids, mask)[:, -1, :]

    @torch.inference_mode()
    def prefill_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    all_logits: bool = False) -> torch.Tensor:
        """`prefill` of an already padded batch; the logits (rows, positions, vocab) of
        the last position, or of every position with `all_logits`."""
        self.cache = new_cache(self.model)
        padded = not bool(attention_mask.all())
        kwargs: dict[str, Any] = {}
        if not all_logits and accepts_logits_to_keep(self.model):
            kwargs["logits_to_keep"] = 1
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0) if padded else None
        out = self.model(input_ids=input_ids, attention_mask=attention_mask if padded else None,
                         position_ids=positions, use_cache=True,
                         **cache_kwargs(self.model, self.cache), **kwargs)
        self.cache = returned_cache(out)
        self.attention_mask = attention_mask if padded else None
        self.positions = positions[:, -1] + 1 if padded else None
        self.length = input_ids.shape[1]
        return out.logits.float()

    @torch.inference_mode()
    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        k = tokens.shape[1]
        positions = None
        if self.attention_mask is not None:
            ones = self.attention_mask.new_ones((tokens.shape[0], k))
            self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
            positions = self.positions[:, None] + torch.arange(k, device=tokens.device)
            self.positions = self.positions + k
        out = self.model(input_ids=tokens, attention_mask=self.attention_mask,
                         position_ids=positions, use_cache=True,
                         **cache_kwargs(self.model, self.cache))
        self.cache = returned_cache(out)
        self.length += k
        return out.logits.float()

    def _crop(self, length: int) -> None:
        removed = self.length - length
        self.cache.crop(-removed)  # transformers 5: a negative count removes that many
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[:, :length]
        if self.positions is not None:
            self.positions = self.positions - removed

    def _reorder(self, indices: torch.Tensor) -> None:
        self.cache.reorder_cache(indices)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.index_select(0, indices)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, indices)
