"""The lean backend: genlib's own Llama forward in torch (`genlib.backends.llama`), one
row over a preallocated KV cache. Bit-identical logits to transformers' forward, at a
fraction of its per-step bookkeeping; every operation but several rows and reorder."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from genlib.backends.base import Backend, Capabilities
from genlib.backends.fit import (
    bitsandbytes_refusal,
    common_refusal,
    compiled_refusal,
    lean_allowed,
    no_lean_refusal,
)
from genlib.backends.fit import lean_of as lean_model_of
from genlib.backends.llama import LeanCache, LeanLlama

if TYPE_CHECKING:
    from genlib.backends.fit import Request
    from genlib.models.info import LoadedModel

STATIC_BUCKET = 256  # cache capacities are rounded up to this (compiled steps get reused)


def cache_capacity(needed: int, max_positions: int | None) -> int:
    """Slots to allocate: `needed` rounded up to a bucket, within the model's positions."""
    length = -(-needed // STATIC_BUCKET) * STATIC_BUCKET
    return min(length, max_positions) if max_positions else length


class LeanBackend(Backend):
    """One row through a `LeanLlama`, its cache a `LeanCache` of its own."""

    name = "lean"
    capabilities = Capabilities(rows=1, reorder=False, extend=True, crop=True, hidden=True)

    @classmethod
    def supports(cls, lm: LoadedModel, request: Request) -> str | None:
        return (common_refusal(cls.name, lm, request, hidden=True, one_row=True)
                or bitsandbytes_refusal(cls.name, lm) or no_lean_refusal(cls.name, lm))

    @classmethod
    def passed_over(cls, lm: LoadedModel, request: Request) -> str | None:
        if not lean_allowed():
            return "GENLAB_LEAN=0 keeps auto off the lean forward"
        if lm.device.type != "cpu" and lm.dtype_name == "float32" and request.hidden is None:
            if compiled_refusal(lm, request) is None:
                return (f"on {lm.device.type} the compiled step is faster than the lean "
                        f"forward's eager one")
        return None

    @classmethod
    def picked(cls, lm: LoadedModel, request: Request) -> str:
        if request.hidden is not None:  # the native backend's refusal says why
            return "the lean forward, which gives hidden states"
        if lm.dtype_name != "float32":
            return (f"one row in {lm.dtype_name} on {lm.device.type}: the lean forward, "
                    f"exact; a compiled step sums in another order")
        return "the lean forward"

    @classmethod
    def build(cls, lm: LoadedModel, request: Request) -> Backend:
        lean = lean_model_of(lm)
        assert lean is not None  # `supports` said so
        return cls(lm, lean)

    def __init__(self, lm: LoadedModel, lean: LeanLlama) -> None:
        super().__init__(lm)
        self.lean = lean
        self.cache: LeanCache | None = None

    @property
    def weight_bytes(self) -> int:
        return self.lean.weight_bytes

    def _prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor | None:
        self.cache = self.lean.new_cache(cache_capacity(capacity, self.lm.max_positions))
        ids = torch.tensor([list(rows[0])], dtype=torch.long, device=self.lean.device)
        logits = self.lean.prefill(ids, self.cache)
        self.length = self.cache.length
        return logits

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self._one_token(tokens.view(1, 1))
        self.length = self._cache().length
        return logits

    def _one_token(self, token: torch.Tensor) -> torch.Tensor:
        """One token (1, 1) through this backend's step; its logits (1, vocab)."""
        return self.lean.step(token, self._cache())

    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] == 1:
            return self._step(tokens[:, 0])[:, None]
        logits = self.lean.extend(tokens, self._cache())
        self.length = self._cache().length
        return logits

    def _crop(self, length: int) -> None:
        self._cache().crop(length)

    def _prefill_states(self, prompt: Sequence[int], capacity: int, layers: tuple[int, ...],
                        spare: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache = self.lean.new_cache(cache_capacity(capacity, self.lm.max_positions),
                                         spare)
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.lean.device)
        return self._states(ids, layers)

    def _step_states(self, token: int, layers: tuple[int, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([[token]], dtype=torch.long, device=self.lean.device)
        return self._states(ids, layers)

    def _states(self, ids: torch.Tensor, layers: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, states = self.lean.forward_states(ids, self._cache(), layers)
        self.length = self._cache().length
        return logits, states

    def _candidates(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lean.candidates(tokens.to(self.lean.device), self._cache())

    def _keep_candidate(self, index: int) -> None:
        self.lean.keep_candidate(self._cache(), index)
        self.length = self._cache().length

    def _cache(self) -> LeanCache:
        if self.cache is None:
            raise RuntimeError("prefill() first")
        return self.cache
