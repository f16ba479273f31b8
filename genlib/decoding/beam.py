"""Beam search over genlib's KV cache: plain, sampled, diverse and constrained.

Keep the k most probable sequences at each step (seed notes: ("The", "dog", "has") wins
over ("The", "nice", "woman") because 0.4 * 0.9 > 0.5 * 0.4). Every prompt is prefilled
once, its cache rows repeated to k beams, and all beams of all prompts go through one
batched forward per step; the cache rows are then reordered by parent beam. The search is
a stepper of the decode loop (`BeamSearch` on `genlib.decoding.loop.run`), which applies
that reorder and feeds the new tokens.

Scoring follows transformers' `generate(num_beams=k)` (v5 `_beam_search`), so results are
token-identical to it: each step keeps the top `max(2, 1 + n_eos) * k` continuations; a
continuation that ends (end id, stop string, token budget) among the first k becomes a
finished hypothesis with score `sum_logprob / generated_length ** length_penalty`
(the end token counts); the others continue. `early_stopping`: True stops when k
hypotheses are finished; False stops when the best running beam, scored at its current
length, cannot beat the worst finished one; "never" scores it at the longest possible
length when length_penalty > 0 (the canonical stopping rule).

Diverse beam search (Vijayakumar et al., 2016, "Diverse Beam Search"): the beams form
`num_beam_groups` groups searched one after the other at each step; a group's scores are
lowered by `diversity_penalty` times the number of times earlier groups picked the token
at this step (Hamming diversity). Constrained beam search: see `genlib.sampling.constraints`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from genlib.backends.base import Backend
from genlib.backends.choose import Request
from genlib.backends.combined import for_generation
from genlib.decoding import loop
from genlib.decoding.detok import IncrementalDecoder, token_text
from genlib.decoding.step import (
    Finisher,
    Plan,
    check_prompts,
    context_of,
    interrupt,
    new_row,
    process_logits,
    row_seeds,
    suppress_eos_for,
)
from genlib.events import BeamStep, Event, Prefill
from genlib.models.loading import LoadedModel
from genlib.sampling import constraints as cons
from genlib.sampling import draws as sampling
from genlib.sampling import grammar, processors
from genlib.sampling.stopping import StopStrings
from genlib.settings.config import GenerationSettings

DEAD = -1.0e9  # score of beams that must not be extended (as transformers uses)


def length_score(sum_logprob: Any, length: int, length_penalty: float) -> Any:
    """A hypothesis's ranking score: its summed logprob (a float or a tensor of them)
    over `length ** length_penalty` (transformers' BeamHypotheses.add; length >= 1)."""
    return sum_logprob / (max(length, 1) ** length_penalty)


@dataclass(frozen=True)
class Hypothesis:
    """One finished sequence. `logprobs` are the model's per-token log-probabilities
    (before processors); `sum_logprob` is their sum; `score` is the search's ranking
    score, `sum of processed logprobs / len ** length_penalty` (transformers'
    `sequences_scores`; it equals sum_logprob / len ** lp when no processor or diversity
    penalty changed the distribution). `constraints_satisfied` is None without
    constraints."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    sum_logprob: float
    score: float
    text: str
    finish_reason: str
    constraints_satisfied: bool | None = None


@dataclass(frozen=True)
class TreeCandidate:
    """One continuation considered at a step: `parent` is the index of the beam it
    extends in the previous step's `kept` order (0 at the first step: the prompt's one
    live beam); `status` is kept,
    finished, pruned (not among the best) or rejected (ended before its constraints
    were met, or after the search stopped accepting)."""

    group: int
    parent: int
    token_id: int
    token: str
    prob: float
    score: float
    status: str
    slot: int | None = None  # its beam index next step, when kept


@dataclass(frozen=True)
class TreeStep:
    step: int
    candidates: tuple[TreeCandidate, ...]


@dataclass
class BeamResult:
    """The n-best hypotheses of one prompt, best first, and the search tree if recorded."""

    prompt_index: int
    hypotheses: list[Hypothesis]
    tree: list[TreeStep] | None = None
    steps: int = 0

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C cut the search short (its hypotheses are the best so far)."""
        return any(h.finish_reason == "interrupted" for h in self.hypotheses)


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[float]
    state: cons.State = ()


@dataclass
class _Done:
    score: float
    beam: _Beam
    reason: str
    satisfied: bool
    # Extends a DEAD placeholder (fewer live continuations than beams): it counts for the
    # stopping rule, as in transformers, but is no sequence the search found.
    placeholder: bool = False


@dataclass
class _Search:
    """One prompt's group of beams."""

    prompt_index: int
    group: int
    prompt_ids: tuple[int, ...]
    running: list[_Beam]
    scores: torch.Tensor  # (group_size,) float32 summed processed logprobs
    generator: torch.Generator | None
    finished: list[_Done] = field(default_factory=list)
    improvable: bool = True
    done: bool = False


@dataclass
class _Plan:
    settings: GenerationSettings
    group_size: int
    groups: int
    n_keep: int
    eos: frozenset[int]
    chain: list[processors.Stage]
    suppress_eos: processors.Processor | None
    constraints: tuple[cons.Constraint, ...]
    tokenizer: Any
    finisher: Finisher
    record_tree: bool
    one_row: bool = False
    tree: dict[int, list[TreeStep]] = field(default_factory=dict)

    def loop_plan(self) -> Plan:
        """The plan the decode loop runs the search under: its settings and stop rules
        (the search keeps its own context, generators and chain state)."""
        return Plan(settings=self.settings, chain=self.chain,
                    sampler=sampling.pick_sampler(False, False), generators=None,
                    suppress_eos=None, needs_context=False, seeds=[],
                    finisher=self.finisher)


def backend_request(prompts_ids: Sequence[Sequence[int]], settings: GenerationSettings,
                    backend: str) -> Request:
    """What the search needs of its backend: every prompt's beams at once, reordered."""
    return Request(rows=len(prompts_ids) * settings.num_beams, reorder=True, backend=backend)


def beam_search(lm: LoadedModel, prompts_ids: Sequence[Sequence[int]],
                settings: GenerationSettings, *, record_tree: bool = False,
                seeds: Sequence[int] | None = None, backend: Backend | None = None
                ) -> list[BeamResult]:
    """Beam search (plain, sampled with `do_sample`, diverse with `num_beam_groups`,
    constrained with `force_words` / `force_any`) for every prompt; one BeamResult per
    prompt holding its `num_return_sequences` best hypotheses. `seeds`: one per prompt
    for beam sampling (default: derived from settings.seed). `backend`: default the one
    `choose_backend`'s auto picks."""
    run = search(lm, prompts_ids, settings, record_tree=record_tree, seeds=seeds,
                 backend=backend)
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return stop.value


def search(lm: LoadedModel, prompts_ids: Sequence[Sequence[int]],
           settings: GenerationSettings, *, record_tree: bool = False,
           seeds: Sequence[int] | None = None, backend: Backend | None = None
           ) -> Generator[Prefill | BeamStep, None, list[BeamResult]]:
    """`beam_search` as it runs: yields the Prefill event and a BeamStep per prompt and
    step (with the tree's candidates when `record_tree`), returns the results. Ctrl-C
    thrown into it (`.throw(KeyboardInterrupt)`) ends the search with the best beams so
    far, marked interrupted; before the first step (no beams yet) it goes on as
    KeyboardInterrupt."""
    check_prompts(lm, prompts_ids, settings)
    if backend is None:
        backend = for_generation(lm, prompts_ids, settings,
                                 backend_request(prompts_ids, settings, "auto"))
    return _searching(BeamSearch(lm, prompts_ids, settings, record_tree, seeds), backend)


def _searching(searcher: BeamSearch, backend: Backend
               ) -> Generator[Prefill | BeamStep, None, list[BeamResult]]:
    """The search's Prefill and BeamStep events, then its results. A Ctrl-C before the
    first step has no beams to keep, and goes on as KeyboardInterrupt."""
    events = searcher.events(backend)
    for event in events:
        if isinstance(event, (Prefill, BeamStep)):
            try:
                yield event
            except KeyboardInterrupt:  # thrown in: the loop keeps the best beams so far
                deque(interrupt(events), maxlen=0)
                break
    if searcher.results is None:
        raise KeyboardInterrupt
    return searcher.results


def search_events(lm: LoadedModel, prompts_ids: Sequence[Sequence[int]],
                  settings: GenerationSettings, backend: Backend, *,
                  seeds: Sequence[int] | None = None,
                  record_tree: bool = False) -> Iterator[Event]:
    """Beam search as genlib's event stream: Prefill; per step and prompt a BeamStep
    (the running best, the tree's candidates with `record_tree`), then Token events for
    each prompt's best row's newly settled tokens; at the end, per returned sequence its
    remaining Token events and a Finish (row = prompt_index * num_return_sequences +
    rank, `score` set). `seeds`: one per row, as the plain loop takes them."""
    n = settings.num_return_sequences
    prompt_seeds = None if seeds is None else list(seeds)[::n]
    yield from BeamSearch(lm, prompts_ids, settings, record_tree, prompt_seeds).events(backend)


@dataclass(frozen=True)
class _Settled(BeamStep):
    """A BeamStep that also carries the settled tokens of its prompt's best row (for
    `BeamSearch`'s commits; consumers see a BeamStep)."""

    ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()


class BeamSearch:
    """Beam search as the decode loop's stepper (`loop.run`): each step advances every
    search by one token (`_search_step`); the loop reorders the cache rows by parent
    beam (`Chosen.parents`, the select-and-reorder hook) and feeds the new tokens. The
    loop's rows are the outputs, `num_return_sequences` per prompt: each prompt's first
    row takes the tokens every beam that can still win shares, as they settle; when the
    search is done (or Ctrl-C stops it), each row takes its hypothesis' remaining tokens
    and ends with the hypothesis' reason and score. The search keeps its own context
    (one row per beam)."""

    draft_weights = None

    def __init__(self, lm: LoadedModel, prompts_ids: Sequence[Sequence[int]],
                 settings: GenerationSettings, record_tree: bool,
                 seeds: Sequence[int] | None) -> None:
        self.lm = lm
        self.prompts_ids = [tuple(p) for p in prompts_ids]
        self.plan = _make_plan(lm, settings, record_tree, max(map(len, self.prompts_ids)))
        self.searches = _make_searches(lm, self.prompts_ids, self.plan, seeds)
        self.per_prompt = settings.num_return_sequences
        self.rows = [new_row(lm, p, prompt, settings)
                     for p, prompt in enumerate(self.prompts_ids) for _ in range(self.per_prompt)]
        self.context: torch.Tensor | None = None
        self.steps = 0
        self.results: list[BeamResult] | None = None

    def events(self, backend: Backend) -> Iterator[Event]:
        """The search on the decode loop, as genlib's event stream."""
        return loop.run(self.lm, backend, self.plan.loop_plan(), self.rows, self)

    def prefill(self, backend: Backend, plan: Plan, prompts: Sequence[Sequence[int]],
                capacity: int) -> torch.Tensor:
        logits, self.context = _prefill_beams(self.lm, backend, self.prompts_ids, self.plan,
                                              capacity)
        return logits

    def choose(self, backend: Backend, plan: Plan, context: torch.Tensor | None,
               logits: torch.Tensor | None, step: int) -> loop.Chosen:
        assert logits is not None
        self.steps = step + 1
        parents, tokens = _search_step(self.plan, self.searches, logits, self.context, step)
        events = tuple(_beam_step(self.plan, self.searches, p, step)
                       for p in range(len(self.prompts_ids)))
        for event in events:
            self._first_step(event.prompt_index * self.per_prompt, event.time)
        if all(s.done for s in self.searches):
            return self._final(events, interrupted=False)
        rows: list[list[loop.Commit]] = [[] for _ in self.rows]
        for event in events:
            number = event.prompt_index * self.per_prompt
            rows[number] = self._commits(number, event.ids, event.logprobs)
        new = torch.tensor(tokens, dtype=torch.long, device=self.lm.device)
        order = None
        if parents != list(range(len(parents))):  # no cache copy when no beam moved
            order = torch.tensor(parents, dtype=torch.long, device=self.lm.device)
            self.context = self.context.index_select(0, order) \
                if self.context is not None else None
        if self.context is not None:
            self.context = torch.cat([self.context, new[:, None]], dim=1)
        return loop.Chosen(rows, new, events, parents=order, ends=[None] * len(self.rows))

    def forward(self, backend: Backend, tokens: torch.Tensor) -> torch.Tensor:
        return backend.step(tokens)

    def interrupted(self) -> loop.Chosen | None:
        """The best beams so far, marked interrupted; None before the first step (the
        rows end "interrupted" with no tokens, as the plain loop's do)."""
        if not self.steps:
            return None
        return self._final((), interrupted=True)

    def _first_step(self, number: int, now: float) -> None:
        """The first step chose every row's first token, though none is settled yet: its
        time is the rows' first token, so the decode time (and tokens/s) runs from there,
        not from the end, where most of a beam's tokens are settled at once."""
        for row in self.rows[number:number + self.per_prompt]:
            if row.first_token is None:
                row.first_token = now

    def _commits(self, number: int, ids: Sequence[int], logprobs: Sequence[float]
                 ) -> list[loop.Commit]:
        """Row `number`'s commits: the tokens of `ids` past those the loop has given it
        (a Ctrl-C may have stopped it short of a step's)."""
        first = len(self.rows[number].ids)
        return [(ids[i], logprobs[i], None, None) for i in range(first, len(ids))]

    def _final(self, events: tuple[Event, ...], interrupted: bool) -> loop.Chosen:
        """The results; each row's hypothesis' remaining tokens and its end. A prompt
        with fewer hypotheses than rows leaves its last rows without one."""
        self.results = [_result(self.plan, self.searches, p, self.steps, interrupted)
                        for p in range(len(self.prompts_ids))]
        rows: list[list[loop.Commit]] = [[] for _ in self.rows]
        ends: list[loop.End | None] = [None] * len(self.rows)
        for result in self.results:
            for rank, hyp in enumerate(result.hypotheses):
                number = result.prompt_index * self.per_prompt + rank
                rows[number] = self._commits(number, hyp.token_ids, hyp.logprobs)
                ends[number] = loop.End(hyp.finish_reason, hyp.score)
        return loop.Chosen(rows, events=events, ends=ends, final=True)


def _beam_step(plan: _Plan, searches: list[_Search], prompt_index: int, number: int
               ) -> _Settled:
    """The step's event for one prompt: its best running beam, the tree's candidates
    of this step (when recorded), and the tokens every beam that can still win shares
    (running beams and finished hypotheses alike)."""
    mine = [s for s in searches if s.prompt_index == prompt_index]
    running = [(length_score(sc, len(b.tokens), plan.settings.length_penalty), b)
               for s in mine for b, sc in zip(s.running, s.scores.tolist()) if sc > DEAD / 2]
    alive = [b for _, b in running] + [d.beam for s in mine for d in s.finished]
    best_score, best = max(running, key=lambda pair: pair[0], default=(0.0, _Beam([], [])))
    shared = _shared_prefix([b.tokens for b in alive])
    tree = plan.tree.get(prompt_index, []) if plan.record_tree else []
    candidates = tree[-1].candidates if tree and tree[-1].step == number else ()
    head = alive[0] if alive else best
    return _Settled(number, prompt_index, tuple(best.tokens), float(best_score), candidates,
                    time.perf_counter(), tuple(head.tokens[:shared]),
                    tuple(head.logprobs[:shared]))


def _shared_prefix(sequences: list[list[int]]) -> int:
    if not sequences:
        return 0
    n = min(len(s) for s in sequences)
    first = sequences[0]
    for i in range(n):
        if any(s[i] != first[i] for s in sequences):
            return i
    return n


def _make_plan(lm: LoadedModel, settings: GenerationSettings, record_tree: bool,
               prompt_width: int) -> _Plan:
    # GenerationSettings has checked num_beams against groups and outputs already.
    group_size = settings.num_beams // settings.num_beam_groups
    eos = frozenset() if settings.ignore_eos else frozenset(lm.eos_ids)
    constraints = cons.build_constraints(lm.tokenizer, settings.force_words, settings.force_any,
                                         settings.max_new_tokens, settings.stop_strings)
    suppress = suppress_eos_for(lm, settings)
    one_row = _one_row(settings, constraints)
    # transformers keeps max(2, 1 + n_eos) * k continuations, so k can still run on
    # even if the best ones all end; beam sampling's truncations leave as many per beam.
    # One row keeps its one continuation, as greedy decoding and sampling do.
    per_beam = 1 if one_row else max(2, 1 + len(eos))
    n_keep = min(per_beam * group_size, group_size * lm.vocab_size)
    constraint = grammar.compile_for(lm.tokenizer, lm.vocab_size, lm.eos_ids, settings)
    chain = processors.build_processors(settings, prompt_width=prompt_width,
                                        tokenizer=lm.tokenizer, constraint=constraint,
                                        vocab_size=lm.vocab_size, min_keep=per_beam)
    return _Plan(settings, group_size, settings.num_beam_groups, n_keep, eos, chain, suppress,
                 constraints, lm.tokenizer, Finisher(settings, chain), record_tree, one_row)


def _one_row(settings: GenerationSettings, constraints: Sequence[cons.Constraint]) -> bool:
    """Whether the search is one unconstrained beam: transformers' generate(num_beams=1)
    decodes that greedily or samples it (processors on the logits, one token drawn from
    what they leave), so a beam of one must too."""
    return settings.num_beams == 1 and not constraints


def _make_searches(lm: LoadedModel, prompts_ids: Sequence[Sequence[int]], plan: _Plan,
                   seeds: Sequence[int] | None) -> list[_Search]:
    """One search per (prompt, group); beam 0 of each starts at score 0 and the others
    at DEAD, so the first step does not pick the same token k times."""
    s = plan.settings
    # One generator per prompt, seeded as decode seeds its rows.
    prompt_seeds = row_seeds(s, len(prompts_ids), seeds) if s.do_sample else None
    searches = []
    for p, prompt in enumerate(prompts_ids):
        generator = (sampling.make_generator(prompt_seeds[p], lm.device)
                     if prompt_seeds is not None else None)
        for g in range(plan.groups):
            scores = torch.full((plan.group_size,), DEAD, dtype=torch.float32, device=lm.device)
            scores[0] = 0.0
            beams = [_Beam([], [], cons.initial_state(plan.constraints))
                     for _ in range(plan.group_size)]
            searches.append(_Search(p, g, tuple(prompt), beams, scores, generator))
    return searches


def _prefill_beams(lm: LoadedModel, backend: Backend, prompts_ids: Sequence[Sequence[int]],
                   plan: _Plan, capacity: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill each prompt once, then repeat its cache rows to num_beams rows."""
    logits = backend.prefill(prompts_ids, capacity)
    assert logits is not None  # prompts are never empty here
    rows = torch.arange(len(prompts_ids), device=lm.device).repeat_interleave(
        plan.settings.num_beams)
    backend.reorder(rows)
    context = context_of(prompts_ids, lm.device).index_select(0, rows) \
        if plan.chain else None
    return logits.index_select(0, rows), context


def _processed_logprobs(plan: _Plan, context: torch.Tensor | None, logits: torch.Tensor,
                        logprobs: torch.Tensor, step: int) -> torch.Tensor:
    """The core's processors applied as transformers applies them: to the
    log-probabilities in beam search, to the logits (then normalised) for one row."""
    if plan.one_row:
        return process_logits(plan.settings, plan.chain, plan.suppress_eos, context, logits,
                              step).log_softmax(dim=-1)
    return process_logits(plan.settings, plan.chain, plan.suppress_eos, context, logprobs,
                          step)


def _search_step(plan: _Plan, searches: list[_Search], logits: torch.Tensor,
                 context: torch.Tensor | None, step: int) -> tuple[list[int], list[int]]:
    """Advance every search by one token; return each new row's parent row and token."""
    raw = logits.log_softmax(dim=-1)
    processed = _processed_logprobs(plan, context, logits, raw, step)
    last = plan.finisher.last(step, time.perf_counter())
    parents: list[int] = []
    tokens: list[int] = []
    picked: list[int] = []  # tokens earlier groups of this prompt chose at this step
    for number, search in enumerate(searches):
        if search.group == 0:
            picked = []
        first = number * plan.group_size
        rows = slice(first, first + plan.group_size)
        if search.done:
            parents.extend(range(first, first + plan.group_size))
            tokens.extend([0] * plan.group_size)
            continue
        scores = _diversity(plan, processed[rows], picked)
        chosen = _group_step(plan, search, scores, raw[rows], step, last)
        parents.extend(first + b for b, _ in chosen)
        tokens.extend(t for _, t in chosen)
        picked.extend(t for _, t in chosen)
    return parents, tokens


def _diversity(plan: _Plan, scores: torch.Tensor, picked: list[int]) -> torch.Tensor:
    """Hamming diversity (Vijayakumar et al., 2016): lower each token's score by
    diversity_penalty times how often earlier groups chose it at this step."""
    if not picked or plan.settings.diversity_penalty == 0:
        return scores
    counts = torch.bincount(torch.tensor(picked, device=scores.device),
                            minlength=scores.shape[-1]).to(scores.dtype)
    return scores - plan.settings.diversity_penalty * counts


def _candidates(plan: _Plan, search: _Search, acc: torch.Tensor) -> torch.Tensor:
    """Flat indices (beam * vocab + token) of the continuations to consider, in the
    order beams are allocated: best first, or banked round robin with constraints."""
    flat = acc.reshape(-1)
    if search.generator is not None:
        probs = sampling.finite(flat.softmax(-1))
        count = min(plan.n_keep, int((probs > 0).sum()))
        index = torch.multinomial(probs, count, generator=search.generator)
        index = index[flat[index].argsort(descending=True, stable=True)]
    else:
        index = torch.topk(flat, plan.n_keep).indices
    if not plan.constraints:
        return index
    return _banked(plan, search, flat, index, acc.shape[-1])


def _banked(plan: _Plan, search: _Search, flat: torch.Tensor, index: torch.Tensor,
            vocab: int) -> torch.Tensor:
    """Add, for every live beam, the tokens that advance its constraints, then order all
    candidates by bank round robin (Post & Vilar, 2018)."""
    chosen = index.tolist()
    seen = set(chosen)
    for b, beam in enumerate(search.running):
        if search.scores[b] <= DEAD / 2:
            continue
        for token in sorted(cons.advancing_tokens(plan.constraints, beam.state)):
            # a token a processor banned (score -inf) cannot advance anything
            if b * vocab + token not in seen and flat[b * vocab + token] > DEAD / 2:
                seen.add(b * vocab + token)
                chosen.append(b * vocab + token)
    scores = flat[torch.tensor(chosen, device=flat.device)].tolist()
    banks = [cons.bank(plan.constraints, cons.advance(plan.constraints,
             search.running[i // vocab].state, i % vocab)) for i in chosen]
    order = cons.round_robin(banks, scores)
    return torch.tensor([chosen[i] for i in order], device=flat.device)


def _group_step(plan: _Plan, search: _Search, scores: torch.Tensor, raw: torch.Tensor,
                step: int, last: bool) -> list[tuple[int, int]]:
    """One step of one group: pick continuations, finish or keep them, update the
    stopping heuristic. Returns (parent beam, token) for the group's new beams."""
    k = plan.group_size
    total = scores + search.scores[:, None]
    index = _candidates(plan, search, total)
    acc = total.reshape(-1)[index]
    kept, leftovers, records = _sort_out(plan, search, index, acc, raw, step, last)
    _trim_finished(search, k)
    live = len(kept)
    # Like transformers: if fewer than k continuations go on, ended ones fill the beam
    # with a DEAD score so they are never extended into a result.
    kept += leftovers[:k - live]
    new_scores = acc[torch.tensor([rank for rank, _, _ in kept], device=acc.device)]
    new_scores[live:] += DEAD
    if len(kept) < k:  # fewer candidates than beams (sampling from a cut distribution)
        pad = k - len(kept)
        kept += [kept[0]] * pad  # copies of a real continuation, never extended
        new_scores = torch.cat([new_scores, new_scores.new_full((pad,), DEAD)])
    search.running = [beam for _, beam, _ in kept]
    search.scores = new_scores
    if plan.record_tree:
        plan.tree.setdefault(search.prompt_index, []).append(TreeStep(step, tuple(records)))
    _update_stop(plan, search, step, last or live == 0)
    return [(b, beam.tokens[-1]) for _, beam, b in kept]


Picked = list[tuple[int, _Beam, int]]  # (candidate rank, beam, parent beam index)


def _sort_out(plan: _Plan, search: _Search, index: torch.Tensor, acc: torch.Tensor,
              raw: torch.Tensor, step: int, last: bool
              ) -> tuple[Picked, Picked, list[TreeCandidate]]:
    """Walk the candidates in order: an ending one among the first k becomes a finished
    hypothesis, the first k others go on; the rest are pruned."""
    s = plan.settings
    k = plan.group_size
    vocab = raw.shape[-1]
    finished_scores = length_score(acc, step + 1, s.length_penalty).tolist()
    accepting = search.improvable and not (len(search.finished) == k and s.early_stopping is True)
    kept: Picked = []
    leftovers: Picked = []
    records: list[TreeCandidate] = []
    skipped = 0  # ended before meeting its constraints: takes no finishing slot
    for rank, (flat, lp) in enumerate(zip(index.tolist(), raw.reshape(-1)[index].tolist())):
        b, token = divmod(flat, vocab)
        parent = search.running[b]
        beam = _Beam(parent.tokens + [token], parent.logprobs + [lp],
                     cons.advance(plan.constraints, parent.state, token)
                     if plan.constraints else ())
        reason = plan.finisher.candidate_end(plan.tokenizer, plan.eos, search.prompt_ids,
                                             beam.tokens, last)
        status = "pruned"
        if reason is not None:
            status = "rejected"
            ok = cons.satisfied(beam.state)
            if reason == "eos" and not ok:
                skipped += 1
            elif rank - skipped < k and accepting:
                search.finished.append(_Done(finished_scores[rank], beam, reason, ok,
                                             float(acc[rank]) <= DEAD / 2))
                status = "finished"
            leftovers.append((rank, beam, b))
        elif len(kept) < k:
            kept.append((rank, beam, b))
            status = "kept"
        if plan.record_tree:
            records.append(TreeCandidate(search.group, b, token, token_text(plan.tokenizer, token),
                                         math.exp(lp), float(acc[rank]), status,
                                         len(kept) - 1 if status == "kept" else None))
    return kept, leftovers, records


def _trim_finished(search: _Search, k: int) -> None:
    """Keep the k best finished hypotheses (met constraints first)."""
    search.finished.sort(key=lambda d: (d.satisfied, d.score), reverse=True)
    del search.finished[k:]


def _update_stop(plan: _Plan, search: _Search, step: int, ended: bool) -> None:
    """transformers' early-stop rule: stop once k hypotheses are finished and the best
    running beam, scored at its best hypothetical length, cannot beat the worst."""
    s = plan.settings
    k = plan.group_size
    full = len(search.finished) == k
    if full and search.improvable:
        length = step + 1
        if s.early_stopping == "never" and s.length_penalty > 0:
            length = s.max_new_tokens
        best = length_score(search.scores.max(), length, s.length_penalty).item()
        search.improvable = best > min(d.score for d in search.finished)
    search.done = ended or not search.improvable or (full and s.early_stopping is True)


def _decode(tokenizer: Any, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
    """The text of `ids` after the prompt, as the streaming decoder would print it."""
    decoder = IncrementalDecoder(tokenizer, tuple(prompt_ids))
    return "".join(decoder.push(t) for t in ids) + decoder.flush()


def _result(plan: _Plan, searches: list[_Search], prompt_index: int, steps: int,
            interrupted: bool = False) -> BeamResult:
    """Merge the groups' finished hypotheses, best first, leaving out placeholders (so
    fewer than num_return_sequences when fewer sequences could be found, e.g. under a
    grammar). With constraints, only those that meet them, possibly fewer again; if none
    does, the best ones flagged constraints_satisfied=False. An interrupted search ranks
    its running beams with the finished ones and marks every result "interrupted": none
    of them is the search's answer."""
    mine = [s for s in searches if s.prompt_index == prompt_index]
    cut = interrupted and not all(s.done for s in mine)  # this prompt's search was cut
    done = [d for s in mine for d in s.finished if not d.placeholder]
    if cut or not done:  # the running beams compete (of the searches still running)
        done += [_Done(length_score(float(sc), len(b.tokens), plan.settings.length_penalty),
                       b, "length", cons.satisfied(b.state))
                 for s in mine if not (cut and s.done)
                 for b, sc in zip(s.running, s.scores.tolist()) if sc > DEAD / 2]
    done.sort(key=lambda d: (d.satisfied, d.score), reverse=True)
    if done and done[0].satisfied:  # outputs that miss a forced phrase are shown only if all do
        done = [d for d in done if d.satisfied]
    prompt = mine[0].prompt_ids
    hyps = [_hypothesis(plan, prompt, d) for d in done[:plan.settings.num_return_sequences]]
    if cut:  # texts as their own ends left them (stop strings trimmed), then relabelled
        hyps = [dataclasses.replace(h, finish_reason="interrupted") for h in hyps]
    return BeamResult(prompt_index, hyps, plan.tree.get(prompt_index) if plan.record_tree
                      else None, steps)


def _hypothesis(plan: _Plan, prompt: tuple[int, ...], done: _Done) -> Hypothesis:
    text = _decode(plan.tokenizer, prompt, done.beam.tokens)
    if done.reason == "stop":
        stops = StopStrings(plan.settings.stop_strings)
        stops.feed(text)
        text = stops.final_text
    reason = plan.finisher.as_reported(done.beam.tokens, done.reason)
    return Hypothesis(tuple(done.beam.tokens), tuple(done.beam.logprobs),
                      float(sum(done.beam.logprobs)), done.score, text, reason,
                      cons.satisfied(done.beam.state) if plan.constraints else None)
