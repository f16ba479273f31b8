"""genlib's one decode loop: prefill once, then each step a stepper's tokens against the
KV cache, yielding typed events (`genlib.events`). Greedy and sampling share the plain
step; greedy is just the argmax sampler. `genlib.generate.stream` routes here.

    events = decode(lm, [lm.encode("Once upon a time")], settings, backend)

Batches of prompts of different lengths are left-padded; each row stops on its own
(`step.Finisher`: end id, token budget, stop string, time) and leaves the batch when it
does.

How a step picks its tokens and gets the next logits is a `Stepper`: `Sampled` (the
processed distribution's draw, then one forward) here; contrastive search's candidates
(genlib.decoding.contrastive), speculative decoding's draft-and-verify
(genlib.decoding.speculative, which commits several tokens a step) and beam search
(genlib.decoding.beam, which has the loop reorder the cache by parent beam and ends its
rows itself) the others. The loop around them, its events, the reorder and its Ctrl-C
handling are written once."""

from __future__ import annotations

import itertools
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from genlib.backends.base import Backend
from genlib.decoding.detail import Detail
from genlib.decoding.step import (
    Plan,
    Row,
    advance,
    check_prompts,
    choose_tokens,
    choose_with_detail,
    context_of,
    expand_prompts,
    finish_row,
    make_plan,
    new_row,
)
from genlib.events import Event, Prefill
from genlib.models.loading import LoadedModel
from genlib.sampling import processors
from genlib.settings.config import GenerationSettings

# One committed token: (id, logprob under the raw model, per-step record or None, whether
# a drafter proposed it, or None outside speculative decoding).
Commit = tuple[int, float, Any, "bool | None"]


@dataclass(frozen=True, slots=True)
class End:
    """How a stepper that ends its rows itself (beam search) ends one: the reason, and
    the score of the sequence the row holds."""

    reason: str
    score: float | None = None


@dataclass(slots=True)
class Chosen:
    """What one step commits: for each row of the batch, in order, its tokens (one; a
    speculative step's accepted drafts and the target's own; beam search's newly
    settled ones); `feed`, the tokens the next forward takes and the context grows by
    (None where the stepper feeds its own and keeps its own context); `events`, yielded
    before the tokens (Verify, BeamStep).

    The select-and-reorder hook (beam search): `parents` names, for each row of the
    next forward, the cache row it continues (None: row i continues row i). `ends`:
    None where the stop rules (`Finisher`) end rows after each token; else one entry
    per row, the stepper's own `End` after its tokens, or None (the row goes on).
    `final`: the stepper is done, whether or not every row has ended."""

    rows: list[list[Commit]]
    feed: torch.Tensor | None = None
    events: tuple[Event, ...] = ()
    parents: torch.Tensor | None = None
    ends: list[End | None] | None = None
    final: bool = False


class Stepper(Protocol):
    """How a step of the loop picks its tokens and gets the next logits."""

    draft_weights: str | None  # the Prefill event's: how a draft model's weights are held

    def prefill(self, backend: Backend, plan: Plan, prompts: Sequence[Sequence[int]],
                capacity: int) -> torch.Tensor | None:
        """Start the rows on `backend`; the last position's logits (rows, vocab), or None
        where the stepper scores its own positions."""

    def choose(self, backend: Backend, plan: Plan, context: torch.Tensor | None,
               logits: torch.Tensor | None, step: int) -> Chosen:
        """The step's commits; `step` counts the steps so far."""

    def forward(self, backend: Backend, tokens: torch.Tensor) -> torch.Tensor | None:
        """The next step's logits, once the chosen `tokens` (rows,) are in the cache."""

    def interrupted(self) -> Chosen | None:
        """What the stepper commits when Ctrl-C stops the loop (beam search: its best
        sequences so far); None: the rows still running end as they are."""


def one_each(tokens: torch.Tensor, logprobs: torch.Tensor,
             details: list[Any] | None = None) -> Chosen:
    """A step that commits one token a row (`tokens`, their `logprobs`, records), and
    feeds those tokens to the next forward."""
    values = _host_values(tokens, logprobs)
    records = details or [None] * len(values)
    return Chosen([[(tok, lp, record, None)] for (tok, lp), record in zip(values, records)],
                  tokens)


class Sampled:
    """The plain step: prefill the rows, draw each row's token from its processed
    distribution (`choose_tokens`, with the per-step record where the plan asks), feed
    the tokens back as one forward."""

    draft_weights = None

    def prefill(self, backend: Backend, plan: Plan, prompts: Sequence[Sequence[int]],
                capacity: int) -> torch.Tensor:
        logits = backend.prefill(prompts, capacity)
        assert logits is not None  # prompts are never empty here
        return logits

    def choose(self, backend: Backend, plan: Plan, context: torch.Tensor | None,
               logits: torch.Tensor | None, step: int) -> Chosen:
        assert logits is not None
        if plan.records:
            return one_each(*choose_with_detail(plan, context, logits, step))
        return one_each(*choose_tokens(plan, context, logits, step))

    def forward(self, backend: Backend, tokens: torch.Tensor) -> torch.Tensor:
        return backend.step(tokens)

    def interrupted(self) -> None:
        return None


def decode(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
           backend: Backend, *, seeds: Sequence[int] | None = None,
           detail: Detail | None = None) -> Iterator[Event]:
    """Generate for every prompt (`num_return_sequences` rows each) on `backend`; yield
    events. `seeds` gives each row its own sampling seed (default: derived from
    settings.seed); `detail` asks for per-step records on the Token events
    (`genlib.decoding.detail`). On KeyboardInterrupt thrown into the generator (see
    `step.interrupt`), the rows still running finish with reason "interrupted"."""
    check_prompts(lm, prompts, settings)
    expanded = expand_prompts(prompts, settings.num_return_sequences)
    plan = make_plan(lm, settings, len(expanded), seeds, max(len(p) for p in prompts),
                     detail)
    single_token_texts: dict[int, str] = {}
    rows = [new_row(lm, i, ids, settings, single_token_texts) for i, ids in expanded]
    yield from run(lm, backend, plan, rows)


def run(lm: LoadedModel, backend: Backend, plan: Plan, rows: list[Row],
        stepper: Stepper | None = None) -> Iterator[Event]:
    """The loop: prefill, then each step the `stepper`'s commits (default `Sampled`),
    each token's event and the stop rules (`plan.finisher`, or the stepper's own ends),
    finished rows dropped, the stepper's reorder applied, until every row has finished
    or the stepper is done. On KeyboardInterrupt the stepper commits what it keeps
    (`Stepper.interrupted`) and the rows still running finish "interrupted"."""
    stepper = stepper or Sampled()
    start = time.perf_counter()
    plan.finisher.begin(start)
    prompts = [r.prompt_ids for r in rows]
    active = list(range(len(rows)))  # batch position -> row number
    try:
        capacity = max(len(p) for p in prompts) + plan.settings.max_new_tokens
        logits = stepper.prefill(backend, plan, prompts, capacity)
        context = context_of(prompts, lm.device) if plan.needs_context else None
        yield Prefill(tuple(len(p) for p in prompts), time.perf_counter() - start,
                      time.perf_counter(), backend.name, backend.reason,
                      stepper.draft_weights, backend.weight_bytes)
        for step in itertools.count():
            chosen = stepper.choose(backend, plan, context, logits, step)
            yield from chosen.events
            done = yield from _commit(lm, plan, rows, active, chosen, start)
            if chosen.final or len(done) == len(active):
                return
            tokens = chosen.feed
            if done:
                keep = _drop_rows(backend, plan, active, done, lm.device)
                tokens = tokens.index_select(0, keep) if tokens is not None else None
                context = context.index_select(0, keep) if context is not None else None
            if chosen.parents is not None:
                backend.reorder(chosen.parents)
                context = context.index_select(0, chosen.parents) \
                    if context is not None else None
            if tokens is None:  # the stepper feeds its own tokens
                continue
            if context is not None:
                context = torch.cat([context, tokens[:, None]], dim=1)
            logits = stepper.forward(backend, tokens)
    except KeyboardInterrupt:
        kept = stepper.interrupted()
        if kept is not None:
            yield from _commit(lm, plan, rows, active, kept, start)
            if kept.final:
                return
        for row_number in active:
            if not rows[row_number].finished:
                yield from finish_row(rows[row_number], row_number, "interrupted", start)


def _commit(lm: LoadedModel, plan: Plan, rows: list[Row], active: list[int], chosen: Chosen,
            start: float) -> Generator[Event, None, list[int]]:
    """Each row's commits as Token events, each row ended by the stop rules or by the
    stepper's `End` as a Finish event; return the batch positions that ended."""
    now = time.perf_counter()
    done: list[int] = []
    for pos, commits in enumerate(chosen.rows):
        row_number = active[pos]
        row = rows[row_number]
        for token, logprob, detail, drafted in commits:
            event, reason = advance(lm, row, row_number, token, logprob, len(row.ids), now,
                                    detail, drafted)
            if event is not None:
                yield event
            if chosen.ends is None:
                reason = plan.finisher.reason(row.ids, reason, len(row.ids) - 1, now)
                if reason is not None:
                    yield from finish_row(row, row_number, reason, start)
                    done.append(pos)
                    break
        end = chosen.ends[pos] if chosen.ends is not None else None
        if end is not None and not row.finished:  # Ctrl-C amid the ends: once a row
            yield from finish_row(row, row_number, end.reason, start, end.score)
            done.append(pos)
    return done


def _host_values(tokens: torch.Tensor, logprobs: torch.Tensor) -> list[tuple[int, float]]:
    """A step's tokens and logprobs as Python numbers. On a GPU in one host read (each
    read is a synchronisation; token ids < 2**24 are exact in float32); on a CPU each
    read as it is, which costs less than stacking them: right after a step has streamed
    the weights through the caches, the stack's allocation and copy run cold."""
    if tokens.device.type == "cpu":
        return list(zip(tokens.tolist(), logprobs.tolist()))
    picked = torch.stack([tokens.float(), logprobs.float()]).tolist()
    return list(zip(map(int, picked[0]), picked[1]))


def _drop_rows(backend: Backend, plan: Plan, active: list[int], done: list[int],
               device: torch.device) -> torch.Tensor:
    """Remove finished rows from the batch (cache, generators); return kept indices."""
    finished = set(done)
    keep = [pos for pos in range(len(active)) if pos not in finished]
    index = torch.tensor(keep, dtype=torch.long, device=device)
    backend.reorder(index)
    processors.reorder(plan.chain, index)
    if plan.generators is not None:
        plan.generators = [plan.generators[p] for p in keep]
    active[:] = [active[p] for p in keep]
    return index
