"""The combining backend: one backend per model of a `genlib.sampling.combine.Combination`, each
chosen by `choose_backend` as for that model alone (two float32 Llama-style models both
run on the native kernel), stepped together; its logits are the combined log-scores.

Because it is a backend, every loop runs on it unchanged: greedy and sampling, beam
search (`reorder` reorders each model's cache), batches, the REPL. `for_generation` is
where a generation gets its backend: the combined one where the settings ask for a
combination, the model's own otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from genlib.backends.base import Backend, Capabilities
from genlib.backends.choose import Request, choose_backend
from genlib.sampling.combine import Combination, combination_of

if TYPE_CHECKING:
    from genlib.models.info import LoadedModel
    from genlib.settings.config import GenerationSettings


def for_generation(lm: LoadedModel, prompts: Sequence[Sequence[int]],
                   settings: GenerationSettings, request: Request) -> Backend:
    """The backend for one generation of `prompts` on `lm`: `choose_backend`'s, or a
    CombinedBackend where `settings` combine `lm` with its partners (each of which must
    fit the prompts and new tokens in its own positions)."""
    combination = combination_of(lm, settings)
    if combination is None:
        return choose_backend(lm, request)
    for other in combination.models[1:]:
        for prompt in prompts:
            other.check_fits(len(prompt), settings.max_new_tokens,
                             whose=f"the combined model {other.ref}'s")
    return CombinedBackend(combination, [choose_backend(m, request)
                                         for m in combination.models])


class CombinedBackend(Backend):
    """The models of a Combination stepped together (see the module doc)."""

    name = "combined"
    capabilities = Capabilities(rows=None, reorder=True, extend=True, crop=True)

    def __init__(self, combination: Combination, parts: Sequence[Backend]) -> None:
        super().__init__(combination.models[0])
        self.combination = combination
        self.parts = list(parts)
        names = list(dict.fromkeys(p.name for p in self.parts))
        self.name = "+".join(names)  # type: ignore[misc]  # what ran, as --json names it
        self.capabilities = Capabilities(  # type: ignore[misc]  # what every part can do
            rows=min((p.capabilities.rows for p in self.parts
                      if p.capabilities.rows is not None), default=None),
            reorder=all(p.capabilities.reorder for p in self.parts),
            extend=all(p.capabilities.extend for p in self.parts),
            crop=all(p.capabilities.crop for p in self.parts))
        self.reason = f"{combination.describe()}; " + "; ".join(
            f"{p.lm.ref} on {p.name} ({p.reason})" for p in self.parts)

    @property
    def weights(self) -> str:
        return self.parts[0].weights

    @property
    def weight_bytes(self) -> int | None:
        parts = [part.weight_bytes for part in self.parts]
        return None if None in parts else sum(parts)  # type: ignore[arg-type]

    def _prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor | None:
        logits = [part.prefill(rows, capacity) for part in self.parts]
        self.length = self.parts[0].length
        if any(x is None for x in logits):
            return None
        return self.combination.combine(logits)  # type: ignore[arg-type]

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = [part.step(tokens) for part in self.parts]
        self.length = self.parts[0].length
        return self.combination.combine(logits)

    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = [part.extend(tokens) for part in self.parts]
        self.length = self.parts[0].length
        return self.combination.combine(logits)

    def _crop(self, length: int) -> None:
        for part in self.parts:
            part.crop(length)

    def _reorder(self, indices: torch.Tensor) -> None:
        for part in self.parts:
            part.reorder(indices)
        self.length = self.parts[0].length
