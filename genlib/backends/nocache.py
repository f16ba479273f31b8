"""The naive decoder as a backend: no KV cache, so every step runs the whole sequence so
far through transformers' forward again (seed note 004).

Step t costs O(prompt + t) forward positions, so a generation is quadratic where a
cached one is linear. It exists to measure that difference (`genlab bench --no-cache`),
on the same decode loop as every other backend, so its events and tokens are those of
`genlib.generate.stream`. It is never picked by `auto`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from genlib.backends.base import Backend, Capabilities
from genlib.backends.transformers import left_pad

if TYPE_CHECKING:
    from genlib.models.info import LoadedModel


class NoCacheBackend(Backend):
    """Keeps the token ids and their attention mask, not a cache; each call runs them
    all with `use_cache=False`."""

    name = "nocache"
    capabilities = Capabilities(rows=None, reorder=True, extend=True, crop=True)

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        lm.load_model_now()
        self.model = lm.model
        self.ids = torch.empty((1, 0), dtype=torch.long, device=lm.device)
        self.mask = torch.empty((1, 0), dtype=torch.long, device=lm.device)

    def _prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor | None:
        if len(rows) == 1 and len(rows[0]) == 0:
            self.length = 0
            return None
        self.ids, self.mask = left_pad(rows, self.lm.pad_id, self.lm.device)
        self.length = self.ids.shape[1]
        return self._forward(1)[:, -1]

    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        k = tokens.shape[1]
        self.ids = torch.cat([self.ids.expand(tokens.shape[0], -1), tokens], dim=1)
        self.mask = torch.cat([self.mask.expand(tokens.shape[0], -1),
                               torch.ones_like(tokens)], dim=1)
        self.length += k
        return self._forward(k)

    @torch.inference_mode()
    def _forward(self, last: int) -> torch.Tensor:
        """The logits of the last `last` positions (rows, last, vocab), from scratch."""
        padded = not bool(self.mask.all())
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0) if padded else None
        out = self.model(input_ids=self.ids, attention_mask=self.mask if padded else None,
                         position_ids=positions, use_cache=False)
        return out.logits[:, -last:].float()

    def _crop(self, length: int) -> None:
        self.ids, self.mask = self.ids[:, :length], self.mask[:, :length]

    def _reorder(self, indices: torch.Tensor) -> None:
        self.ids = self.ids.index_select(0, indices)
        self.mask = self.mask.index_select(0, indices)
