"""The one interface every forward path offers the decode loops.

A `Backend` runs one model's forward for one generation at a time: `prefill` the prompt
rows, then `step` one token per row or `extend` k tokens per row against the KV cache,
`crop` it back (speculative rollback) and `reorder` its rows (beam search). Each backend
declares what it can do (`Capabilities`); an operation it cannot do raises a
`ConfigError` that names the backend and what would work (`Backend.refuse`). Nothing
falls back silently: which backend runs is decided once, by `genlib.backends.choose`.

    backend = choose_backend(lm, Request(rows=1))       # the fastest exact one
    logits = backend.prefill([prompt_ids], capacity)    # (rows, vocab) float32
    logits = backend.step(tokens)                       # tokens (rows,) -> (rows, vocab)
    logits = backend.extend(tokens)                     # (rows, k) -> (rows, k, vocab)
    drawn, forwards = backend.draft_greedy(feed, gamma, Bans())  # one call (native only)
    backend.crop(length); backend.reorder(indices)

Logits are float32 whatever the model's dtype. Rows are left-padded where a backend
takes several of different lengths; `length` counts the cache's slots, padding included.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from genlib.backends.sizes import step_bytes
from genlib.errors import ConfigError

if TYPE_CHECKING:
    from genlib.backends.fit import Request
    from genlib.models.info import LoadedModel


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do. `rows`: how many rows one generation may hold (None: any);
    `dtypes`/`devices`: where it runs (torch names: "float32", "cpu"; empty: any)."""

    rows: int | None
    reorder: bool
    extend: bool
    crop: bool
    dtypes: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    greedy_draft: bool = False  # `draft_greedy`: a whole greedy draft in one call
    hidden: bool = False  # `prefill_states`, `step_states`, `candidates`: hidden states


@dataclass(frozen=True)
class Bans:
    """For `draft_greedy`: `ids` banned (their logits -inf) at a draft's first `draws`
    draws, the logits otherwise as the model gives them."""

    ids: tuple[int, ...] = ()
    draws: int = 0


class Backend(ABC):
    """One model's forward for one generation at a time (see the module doc). `step` and
    `extend` are the only ways tokens reach the model after prefill."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    reason: str = ""  # why `choose_backend` picked it (shown by --stats, --json, bench)

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.length = 0  # cached slots (padding included)

    # --- Whether it serves a generation (asked by genlib.backends.choose) --------------

    @classmethod
    def supports(cls, lm: LoadedModel, request: Request) -> str | None:
        """Why this backend cannot serve `request` on `lm`, in one line naming what it
        lacks; None when it can."""
        raise NotImplementedError(f"{cls.__name__} is not one of choose.ORDER")

    @classmethod
    def passed_over(cls, lm: LoadedModel, request: Request) -> str | None:
        """Why `auto` leaves a request this backend could serve to a later backend in
        `choose.ORDER` (an environment switch, or inexact or slower here); None: auto
        takes it."""
        return None

    @classmethod
    def picked(cls, lm: LoadedModel, request: Request) -> str:
        """What it is good for here, as --stats, --json and bench say why auto took it."""
        return f"the {cls.name} backend"

    @classmethod
    def build(cls, lm: LoadedModel, request: Request) -> Backend:
        """A fresh backend for one generation, which `supports` said it serves."""
        return cls(lm)

    # --- The operations, checked against the capabilities ------------------------------

    def prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor | None:
        """Start a generation: run the prompt rows (left-padded) into a fresh cache with
        room for `capacity` tokens per row; the last position's logits (rows, vocab).
        None for one empty row (a cache of nothing, which `extend` then fills)."""
        limit = self.capabilities.rows
        if limit is not None and len(rows) > limit:
            raise self.refuse(f"runs {limit} row{'s' if limit > 1 else ''} at a time, "
                              f"not {len(rows)}", "transformers")
        return self._prefill(rows, capacity)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row (rows,) after the cached ones; their logits (rows, vocab)."""
        return self._step(tokens)

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """k tokens per row (rows, k) after the cached ones, in one call (speculative
        verification, chunked prefill); the logits of every one (rows, k, vocab)."""
        if not self.capabilities.extend and tokens.shape[1] > 1:
            raise self.refuse("feeds one token per step, not several", "lean or transformers")
        return self._extend(tokens)

    def crop(self, length: int) -> None:
        """Forget every cached token after the first `length` (speculative rollback)."""
        if not self.capabilities.crop:
            raise self.refuse("cannot roll its cache back (speculative decoding needs that)",
                              "lean, native or transformers")
        if length < self.length:
            self._crop(length)
            self.length = length

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep/duplicate cache rows: row i becomes old row indices[i] (beam search, and
        finished rows leaving a batch)."""
        if not self.capabilities.reorder:
            raise self.refuse("cannot reorder its cache rows (beam search and batches of "
                              "several rows need that)", "transformers")
        self._reorder(indices)

    @property
    def weights(self) -> str:
        """How this backend stores the model's matrices (a torch dtype name)."""
        return self.lm.dtype_name

    @property
    def weight_bytes(self) -> int | None:
        """Bytes of the weights one decode step reads, as this backend holds them, in the
        format it runs (genlib.backends.sizes): transformers' parameters here; None where
        its model is not loaded (a figure never loads one)."""
        return step_bytes(self.lm.model) if self.lm.model_loaded else None

    def draft_greedy(self, feed: Sequence[int], gamma: int, bans: Bans
                     ) -> tuple[list[int], int]:
        """A greedy draft of one row in one call: feed `feed` after the cached tokens,
        then up to `gamma` times take the argmax of the last logits under `bans` and feed
        it (all but the last); a position where nothing is left (every logit -inf or
        NaN) ends the draft. The draws and the forwards run. A draft model's loop
        without Python between its steps, where `capabilities.greedy_draft` says so;
        each draw is torch's argmax of what `extend` would give at its position."""
        if not self.capabilities.greedy_draft:
            raise self.refuse("draws a greedy draft one forward at a time", "native")
        return self._draft_greedy(feed, gamma, bans)

    # --- Hidden states, where `capabilities.hidden` says so (contrastive search, DoLa) --

    def prefill_states(self, prompt: Sequence[int], capacity: int, layers: tuple[int, ...],
                       spare: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill` of one row that also gives, for each of `layers` (numbered as
        transformers' `output_hidden_states`: 0 the embeddings, j layer j's output, the
        last the final norm's), every prompt position's hidden state: (logits (1, vocab),
        states (len(layers), T, hidden)). `spare`: room for that many `candidates` after
        the last token, past `capacity`."""
        self._check_hidden()
        return self._prefill_states(prompt, capacity, layers, spare)

    def step_states(self, token: int, layers: tuple[int, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` of one row with its hidden states (as `prefill_states`, T = 1)."""
        self._check_hidden()
        return self._step_states(token, layers)

    def candidates(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k alternative next tokens (k,) of one row, each one step on: their logits
        (k, vocab) and final hidden states (k, hidden); the cache is unchanged until
        `keep_candidate(i)` keeps one of them."""
        self._check_hidden()
        return self._candidates(tokens)

    def keep_candidate(self, index: int) -> None:
        """Keep candidate `index` of the last `candidates` call as the row's next token."""
        self._check_hidden()
        self._keep_candidate(index)

    def _check_hidden(self) -> None:
        if not self.capabilities.hidden:
            raise self.refuse("gives no hidden states (contrastive search and DoLa need "
                              "them)", "lean")

    def refuse(self, what: str, instead: str) -> ConfigError:
        """The error for an operation this backend cannot do, naming what would work."""
        return ConfigError(f"the {self.name} backend {what}; use --backend {instead} "
                           f"(or auto, which picks one that can)")

    # --- What each backend implements --------------------------------------------------

    @abstractmethod
    def _prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor | None:
        ...

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._extend(tokens[:, None])[:, -1]

    @abstractmethod
    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        ...

    def _crop(self, length: int) -> None:
        raise NotImplementedError

    def _reorder(self, indices: torch.Tensor) -> None:
        raise NotImplementedError

    def _draft_greedy(self, feed: Sequence[int], gamma: int, bans: Bans
                      ) -> tuple[list[int], int]:
        raise NotImplementedError

    def _prefill_states(self, prompt: Sequence[int], capacity: int, layers: tuple[int, ...],
                        spare: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _step_states(self, token: int, layers: tuple[int, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _candidates(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _keep_candidate(self, index: int) -> None:
        raise NotImplementedError

