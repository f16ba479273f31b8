"""The model's forward pass, as the decode loops use it: prefill a (left-padded) batch
of prompts once, then feed new tokens against the KV cache (seed notes 003/004).

Everything that can be decided once (padding, whether the model accepts
`logits_to_keep`) is decided at prefill, not per step.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class KVState:
    """A batch's KV cache and what the next forward needs to extend it.

    `attention_mask` and `positions` are None when no row is padded: the model then
    derives positions from the cache length, which is what it does for a single prompt.
    """

    cache: Any
    attention_mask: torch.Tensor | None
    positions: torch.Tensor | None  # (batch,) position id of the next token per row
    length: int  # tokens in the cache (padding included)

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep/duplicate batch rows (beam search): row i becomes old row rows[i]."""
        self.cache.reorder_cache(rows)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.index_select(0, rows)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, rows)

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` cached tokens (speculative rollback)."""
        removed = self.length - length
        if removed <= 0:
            return
        self.cache.crop(-removed)  # transformers 5: a negative count removes that many
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[:, :length]
        if self.positions is not None:
            self.positions = self.positions - removed
        self.length = length


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
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def prefill(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            cache: Any = None, all_logits: bool = False) -> tuple[torch.Tensor, KVState]:
    """Run the prompts once. Returns the last position's logits (batch, vocab) as float32,
    or every position's (batch, length, vocab) with `all_logits`."""
    padded = not bool(attention_mask.all())
    kwargs: dict[str, Any] = {}
    if not all_logits and accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0) if padded else None
    out = model(input_ids=input_ids, attention_mask=attention_mask if padded else None,
                position_ids=positions, past_key_values=cache or new_cache(model),
                use_cache=True, **kwargs)
    state = KVState(
        cache=out.past_key_values,
        attention_mask=attention_mask if padded else None,
        positions=positions[:, -1] + 1 if padded else None,
        length=input_ids.shape[1],
    )
    logits = out.logits.float()
    return (logits if all_logits else logits[:, -1, :]), state


@torch.inference_mode()
def extend(model: Any, state: KVState, tokens: torch.Tensor) -> torch.Tensor:
    """Feed `tokens` (batch, k) after the cached ones; return their logits
    (batch, k, vocab) as float32. The state grows by k."""
    k = tokens.shape[1]
    positions = None
    if state.attention_mask is not None:
        ones = state.attention_mask.new_ones((tokens.shape[0], k))
        state.attention_mask = torch.cat([state.attention_mask, ones], dim=1)
        positions = state.positions[:, None] + torch.arange(k, device=tokens.device)
        state.positions = state.positions + k
    out = model(input_ids=tokens, attention_mask=state.attention_mask, position_ids=positions,
                past_key_values=state.cache, use_cache=True)
    state.cache = out.past_key_values
    state.length += k
    return out.logits.float()
