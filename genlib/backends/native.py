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

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from genlib.backends.base import Backend, Bans, Capabilities
from genlib.backends.fit import (
    bitsandbytes_refusal,
    common_refusal,
    lean_allowed,
    lean_of,
    native_allowed,
    no_lean_refusal,
    stored_format,
    weights_named,
)
from genlib.backends.kernel import NativeStep
from genlib.backends.kernel import applies as kernel_applies
from genlib.backends.lean import cache_capacity
from genlib.backends.llama import LeanCache, LeanLlama

if TYPE_CHECKING:
    from genlib.backends.fit import Request
    from genlib.models.info import LoadedModel


class NativeBackend(Backend):
    """Rows of one model, each over its own LeanCache, stepped by the native kernel."""

    name = "native"
    capabilities = Capabilities(rows=None, reorder=True, extend=True, crop=True,
                                dtypes=("float32",), devices=("cpu",), greedy_draft=True)

    @classmethod
    def supports(cls, lm: LoadedModel, request: Request) -> str | None:
        refusal = (common_refusal(cls.name, lm, request, native=True)
                   or bitsandbytes_refusal(cls.name, lm) or no_lean_refusal(cls.name, lm))
        if refusal is not None:
            return refusal
        if lm.device.type != "cpu" or lm.dtype_name != "float32":
            return "the native backend cannot run here: the native step runs float32 on the CPU"
        lean = lean_of(lm)
        assert lean is not None  # no_lean_refusal said so
        missing = kernel_applies(lean, request.kernel_weights(lm))
        return f"the native backend cannot run here: {missing}" if missing else None

    @classmethod
    def passed_over(cls, lm: LoadedModel, request: Request) -> str | None:
        if lm.weights is not None:  # --quantize for this kernel: nothing else reads it
            return None
        if not lean_allowed():
            return "GENLAB_LEAN=0 keeps auto off genlib's own forwards"
        if not native_allowed():
            return "GENLAB_NATIVE=0 keeps auto off the native kernel"
        return None

    @classmethod
    def picked(cls, lm: LoadedModel, request: Request) -> str:
        stored = stored_format(lm)
        if lm.weights is not None:
            return f"--quantize {lm.quantize}: weights " \
                f"{weights_named(lm, request.kernel_weights(lm))}"
        if stored is not None:
            article = "an" if stored[0] in "aefhilmnorsx" else "a"  # an nf4, a q8_0
            return f"{article} {stored} checkpoint: weights {weights_named(lm, stored)} as stored"
        lean = lean_of(lm)
        assert lean is not None
        return f"a float32 {lean.arch.name} model on the CPU"

    @classmethod
    def build(cls, lm: LoadedModel, request: Request) -> Backend:
        lean = lean_of(lm)
        assert lean is not None  # `supports` said so
        step = native_step(lean, request.kernel_weights(lm))
        assert step is not None  # `supports` said the kernel applies
        return cls(lm, lean, step)

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

    @property
    def weight_bytes(self) -> int:
        return self.kernel.weight_bytes

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



_steps: weakref.WeakKeyDictionary[LeanLlama, dict[str, NativeStep | None]] = \
    weakref.WeakKeyDictionary()


def native_step(lean: LeanLlama, weights: str = "float32",
                notify: Callable[[str], None] | None = None) -> NativeStep | None:
    """`lean`'s step as one native kernel (genlib.backends.kernel) reading its matrices as
    `weights` (bfloat16: a draft model's), None where it does not apply (`kernel.applies`
    says why); made once for each, on torch's thread count whatever the model's size:
    the kernel has one parallel region a step, so even a small model gains from a second
    thread (benchmarks/bench_threads.py measures it). `notify` hears what the weight
    cache has to say, when this call makes the step (`kernel.packed_weights`)."""
    steps = _steps.setdefault(lean, {})
    if weights not in steps:
        steps[weights] = NativeStep.of(lean, torch.get_num_threads(), weights, notify)
    return steps[weights]
