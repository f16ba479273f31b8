"""The native backend: the lean forward's decode step as one C kernel
(`genlib.backends.kernel`), float32 on a CPU, for any number of rows.

Each row has a KV cache of its own (`LeanCache`, no padding): a step feeds one token to
every row in one kernel call that reads each weight once for all of them
(`NativeStep.step_rows`), and a row's k new tokens go through in one call too
(`NativeStep.extend`: speculative verification), and the prompts of every row together
(`NativeStep.prefill_rows`). A draft model's greedy draft runs whole in one call
(`NativeStep.draft_greedy`). Every row's logits are the bits of a one-token call on its
cache, so a row's tokens do not depend on its batch-mates. Reordering rows (beam search)
moves caches and copies the duplicated ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from genlib.backends.base import Backend, Bans, Capabilities
from genlib.backends.kernel import NativeStep
from genlib.backends.lean import cache_capacity
from genlib.backends.llama import LeanCache, LeanLlama

if TYPE_CHECKING:
    from genlib.models.info import LoadedModel


class NativeBackend(Backend):
    """Rows of one model, each over its own LeanCache, stepped by the native kernel."""

    name = "native"
    capabilities = Capabilities(rows=None, reorder=True, extend=True, crop=True,
                                dtypes=("float32",), devices=("cpu",), greedy_draft=True)

    def __init__(self, lm: LoadedModel, lean: LeanLlama, kernel: NativeStep) -> None:
        super().__init__(lm)
        self.lean = lean
        self.kernel = kernel
        self.caches: list[LeanCache] = []

    def _prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor | None:
        """Every distinct prompt through the kernel at once (`NativeStep.prefill_rows`:
        each weight read once for all of them); a row repeating an earlier row's prompt
        (several outputs, samples of one prompt) takes a copy of its cache and logits,
        the same bits."""
        slots = cache_capacity(capacity, self.lm.max_positions)
        if any(len(row) == 0 for row in rows):
            if len(rows) > 1:
                raise ValueError("every row of a batch needs at least one token")
            self.caches = [self.lean.new_cache(slots)]
            self._update_length()
            return None
        first: dict[tuple[int, ...], int] = {}
        for i, row in enumerate(rows):
            first.setdefault(tuple(row), i)
        fresh = {i: self.lean.new_cache(slots) for i in first.values()}
        logits = self.kernel.prefill_rows([rows[i] for i in fresh], list(fresh.values()))
        row_of = {i: n for n, i in enumerate(fresh)}
        self.caches = [fresh[i] if i in fresh else fresh[first[tuple(row)]].clone()
                       for i, row in enumerate(rows)]
        self._update_length()
        return logits[[row_of[first[tuple(row)]] for row in rows]]

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.tolist()
        if len(ids) == 1:
            logits = self.kernel(ids[0], self.caches[0])
            self.caches[0].length += 1
        else:
            logits = self.kernel.step_rows(ids, self.caches)
        self._update_length()
        return logits

    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] == 1:
            return self._step(tokens[:, 0])[:, None]
        logits = torch.stack([self.kernel.extend(row, cache)
                              for row, cache in zip(tokens.tolist(), self.caches)])
        self._update_length()
        return logits

    @property
    def weights(self) -> str:
        return self.kernel.weights  # its packed copy's, not the model's

    def _draft_greedy(self, feed: Sequence[int], gamma: int, bans: Bans
                      ) -> tuple[list[int], int]:
        if len(self.caches) != 1:
            raise ValueError(f"a greedy draft runs one row, not {len(self.caches)}")
        drawn = self.kernel.draft_greedy(feed, self.caches[0], gamma, bans.ids,
                                         bans.draws)
        self._update_length()
        return drawn

    def _crop(self, length: int) -> None:
        for cache in self.caches:
            cache.crop(length)
        self._update_length()

    def _reorder(self, indices: torch.Tensor) -> None:
        """Row i becomes old row indices[i]: the first row to take a cache takes it, each
        further one a copy (into a cache no row keeps, where there is one)."""
        picks = indices.tolist()
        kept = set(picks)
        spare = [cache for i, cache in enumerate(self.caches) if i not in kept]
        taken: set[int] = set()
        caches = []
        for i in picks:
            source = self.caches[i]
            if i in taken:
                if spare:
                    spare[-1].copy_from(source)
                    caches.append(spare.pop())
                else:
                    caches.append(source.clone())
            else:
                taken.add(i)
                caches.append(source)
        self.caches = caches
        self._update_length()

    def _update_length(self) -> None:
        self.length = max((cache.length for cache in self.caches), default=0)

