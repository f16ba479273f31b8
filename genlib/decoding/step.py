"""What every step of the decode loop shares (the plain step in `genlib.decoding.loop`,
beam search in `genlib.decoding.beam`, speculative decoding in
`genlib.decoding.speculative`): a row's bookkeeping, its seeds, the one processing of a
step's logits, the stop rules (`Finisher`), advancing a row by a token and finishing it,
and keeping Ctrl-C's events."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from genlib.backends.base import Bans
from genlib.decoding import detail as stepdetail
from genlib.decoding.detok import IncrementalDecoder
from genlib.errors import ConfigError
from genlib.events import Event, Finish, Token
from genlib.models.loading import LoadedModel
from genlib.models.memory import check_memory, rows_of
from genlib.sampling import draws as sampling
from genlib.sampling import grammar, processors
from genlib.sampling.stopping import StopStrings
from genlib.settings import config
from genlib.settings.config import GenerationSettings


@dataclass
class Row:
    """What a decode loop tracks for one output sequence (shared with speculative
    decoding, so both stop, detokenize and report exactly alike)."""

    prompt_index: int
    prompt_ids: tuple[int, ...]
    decoder: IncrementalDecoder
    stops: StopStrings
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    first_token: float | None = None
    finished: bool = False


@dataclass
class Plan:
    """Everything the loop needs that can be decided before the first step."""

    settings: GenerationSettings
    chain: list[processors.Stage]
    sampler: sampling.Sampler
    generators: list[torch.Generator] | None
    suppress_eos: processors.suppress_tokens | None
    needs_context: bool
    seeds: list[int]
    finisher: Finisher
    detail: stepdetail.Detail | None = None

    @property
    def records(self) -> bool:
        """Whether steps go through `choose_with_detail` (records or a branch)."""
        d = self.detail
        return d is not None and (d.record or bool(d.force))


def new_row(lm: LoadedModel, prompt_index: int, prompt_ids: Sequence[int],
            settings: GenerationSettings, shared_texts: dict[int, str] | None = None) -> Row:
    """A fresh row: its detokenizer (seeded with the prompt) and stop-string matcher."""
    ids = tuple(prompt_ids)
    return Row(prompt_index, ids, IncrementalDecoder(lm.tokenizer, ids, shared_texts),
               StopStrings(settings.stop_strings))


def expand_prompts(prompts: Sequence[Sequence[int]], n: int) -> list[tuple[int, tuple[int, ...]]]:
    """(prompt_index, ids) for every output row: each prompt n times, consecutively."""
    return [(i, tuple(p)) for i, p in enumerate(prompts) for _ in range(n)]


def row_seeds(settings: GenerationSettings, rows: int, seeds: Sequence[int] | None
              ) -> list[int]:
    """Per-row seeds: given ones, else row 0 uses `settings.seed` itself and row i a seed
    derived from it, so one generation with --seed S always draws the same tokens."""
    if seeds is not None:
        if len(seeds) != rows:
            raise ValueError(f"{len(seeds)} seeds for {rows} rows")
        return list(seeds)
    return config.row_seeds(settings.seed, rows)


def make_plan(lm: LoadedModel, settings: GenerationSettings, rows: int,
              seeds: Sequence[int] | None = None, prompt_width: int = 0,
              detail: stepdetail.Detail | None = None) -> Plan:
    """The plan for `rows` rows. `prompt_width`: the context columns that hold the
    (left-padded) prompts; `detail` asks for per-step records and/or inverse-CDF
    sampling (see `stepdetail.Detail`)."""
    constraint = grammar.compile_for(lm.tokenizer, lm.vocab_size, lm.eos_ids, settings)
    chain = processors.build_processors(settings, prompt_width=prompt_width,
                                        tokenizer=lm.tokenizer, constraint=constraint,
                                        vocab_size=lm.vocab_size)
    suppress = suppress_eos_for(lm, settings)
    all_seeds = row_seeds(settings, rows, seeds)
    generators = ([sampling.make_generator(s, lm.device) for s in all_seeds]
                  if settings.do_sample else None)
    crn = detail is not None and detail.inverse_cdf
    return Plan(settings=settings, chain=chain,
                sampler=sampling.pick_sampler(settings.do_sample, crn),
                generators=generators, suppress_eos=suppress, needs_context=bool(chain),
                seeds=all_seeds, finisher=Finisher(settings, chain), detail=detail)


def suppressed_ids(lm: LoadedModel, settings: GenerationSettings) -> tuple[int, ...]:
    """The ids `process_logits` suppresses while `suppresses_eos` says so: the end ids,
    where `min_new_tokens` or `ignore_eos` asks; () where neither can apply."""
    return tuple(lm.eos_ids) if settings.ignore_eos or settings.min_new_tokens else ()


def suppress_eos_for(lm: LoadedModel, settings: GenerationSettings
                     ) -> processors.suppress_tokens | None:
    """The processor that suppresses `suppressed_ids`; None when there are none."""
    ids = suppressed_ids(lm, settings)
    return processors.suppress_tokens(ids) if ids else None


def suppresses_eos(settings: GenerationSettings, step: int) -> bool:
    """Whether end tokens are suppressed at `step` (new tokens so far): throughout with
    `ignore_eos`, else before `min_new_tokens`. True then False as steps go by."""
    return settings.ignore_eos or step < settings.min_new_tokens


def process_logits(settings: GenerationSettings, chain: Sequence[processors.Processor],
                   suppress_eos: processors.Processor | None, context: torch.Tensor | None,
                   logits: torch.Tensor, step: int) -> torch.Tensor:
    """One step's logits (rows, vocab) as every loop processes them (decode, beam,
    speculative): EOS suppressed before `min_new_tokens` (or throughout with
    `ignore_eos`), then the settings' processor chain."""
    if suppress_eos is not None and suppresses_eos(settings, step):
        logits = suppress_eos(context, logits)
    return processors.apply(chain, context, logits)


def draft_bans(plan: Plan, step: int, count: int) -> Bans | None:
    """What `process_logits` does to `count` positions from `step` (new tokens so far),
    for a greedy draft that runs without it (`Backend.draft_greedy`): the plan's own
    end-token suppression's ids, at the positions `suppresses_eos` names. None where the
    plan runs a processor chain, which only `process_logits` can apply."""
    if plan.chain:
        return None
    if plan.suppress_eos is None:
        return Bans()
    return Bans(plan.suppress_eos.ids,
                sum(suppresses_eos(plan.settings, step + i) for i in range(count)))


def choose_tokens(plan: Plan, context: torch.Tensor | None, logits: torch.Tensor, step: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Process the logits, pick one token per row; return (tokens, model logprobs)."""
    processed = process_logits(plan.settings, plan.chain, plan.suppress_eos, context, logits,
                               step)
    tokens = sampling.sample_rows(plan.sampler, processed, plan.generators)
    processors.observe(plan.chain, processed, tokens)
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def choose_with_detail(plan: Plan, context: torch.Tensor | None, logits: torch.Tensor,
                       step: int
                       ) -> tuple[torch.Tensor, torch.Tensor, list[stepdetail.StepDetail]]:
    """`choose_tokens` with the plan's per-step record: the stages run one at a time
    (the last one's output is what the sampler draws from), a branch's forced token
    replaces the sampled one after the draw (so later draws are unchanged)."""
    assert plan.detail is not None
    suppress = plan.suppress_eos if suppresses_eos(plan.settings, step) else None
    stages = stepdetail.run_stages(plan.chain, suppress, context, logits)
    processed = stages[-1][1]
    draws = None
    if plan.sampler is sampling.inverse_cdf and plan.generators:
        draws = torch.stack([sampling.uniform(g) for g in plan.generators])
        tokens = sampling.pick_by_uniform(processed, draws)
    else:
        tokens = sampling.sample_rows(plan.sampler, processed, plan.generators)
    forced_token = plan.detail.force.get(step)
    forced = [forced_token is not None] * tokens.shape[0]
    if forced_token is not None:
        tokens = torch.full_like(tokens, forced_token)
    processors.observe(plan.chain, processed, tokens)
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs, stepdetail.details(stages, tokens, draws, plan.detail, forced)


def advance(lm: LoadedModel, row: Row, row_number: int, token: int, logprob: float,
             step: int, now: float, detail: stepdetail.StepDetail | None = None,
             draft: bool | None = None) -> tuple[Token | None, str | None]:
    """Record one token for a row; return its event and a finish reason (or None).
    `draft`: the event's, in speculative decoding (whether the draft proposed it)."""
    row.ids.append(token)
    row.logprobs.append(logprob)
    if row.first_token is None:
        row.first_token = now
    is_eos = token in lm.eos_ids and not row.stops.stopped
    text = row.stops.feed(row.decoder.push(token))
    event = Token(row_number, token, text, logprob, step, now, draft=draft, detail=detail)
    if row.stops.stopped:
        return event, "stop"
    if is_eos:
        return event, "eos"
    return event, None


@dataclass
class Finisher:
    """The stop rules every path ends its sequences by (the plain loop, speculation, and
    beam search's candidates): an end id or a stop string (`advance` reports them for a
    row; `candidate_end` finds them for a beam), the token budget, the time limit counted
    from the loop's start (`begin`), and the grammar's say on the reason."""

    settings: GenerationSettings
    chain: Sequence[processors.Stage]
    deadline: float | None = None

    def begin(self, start: float) -> None:
        """Start the clock: `max_time` counts from here."""
        limit = self.settings.max_time
        self.deadline = start + limit if limit else None

    def over(self, now: float) -> bool:
        """Whether the time limit has passed."""
        return self.deadline is not None and now >= self.deadline

    def last(self, step: int, now: float) -> bool:
        """Whether the token at `step` (new tokens before it) is a sequence's last: the
        budget's or the clock's."""
        return step + 1 == self.settings.max_new_tokens or self.over(now)

    def reason(self, ids: Sequence[int], reason: str | None, step: int, now: float
               ) -> str | None:
        """Why a row ends after its token at `step`: the reason `advance` gave (end id,
        stop string), else "time" past the deadline, else "length" at the last step.
        None: the row goes on."""
        if reason is None and self.over(now):
            reason = "time"
        if reason is None and step + 1 == self.settings.max_new_tokens:
            reason = "length"
        return None if reason is None else self.as_reported(ids, reason)

    def candidate_end(self, tokenizer: Any, eos: frozenset[int], prompt_ids: Sequence[int],
                      tokens: Sequence[int], last: bool) -> str | None:
        """Why a candidate sequence (`tokens` after `prompt_ids`) ends with its newest
        token, or None: an id in `eos`, a stop string its newest text completes, or the
        last step (the clock's or the budget's)."""
        if tokens[-1] in eos:
            return "eos"
        if self.settings.stop_strings and _completes_stop(
                tokenizer, self.settings.stop_strings, prompt_ids, tokens):
            return "stop"
        if not last:
            return None
        cut = self.over(time.perf_counter()) and len(tokens) < self.settings.max_new_tokens
        return "time" if cut else "length"

    def as_reported(self, ids: Sequence[int], reason: str) -> str:
        """The finish reason as the grammar constraining the sequence reports it."""
        return grammar.finish_reason(processors.grammar_of(self.chain), ids, reason)


def _completes_stop(tokenizer: Any, stops: Sequence[str], prompt_ids: Sequence[int],
                    tokens: Sequence[int]) -> bool:
    """Whether the newest text of `tokens` completes a stop string. Only a window of
    recent tokens is decoded (a stop string of n characters spans at most n tokens),
    with one token of left context so a leading space survives; a match must end after
    it."""
    window = max(len(stop) for stop in stops) + 1
    ids = (tuple(prompt_ids[-1:]) + tuple(tokens))[-window:]
    context = len(_plain_decode(tokenizer, ids[:1]))
    text = _plain_decode(tokenizer, ids)
    return any(text.find(stop, max(0, context - len(stop) + 1)) >= 0 for stop in stops)


def _plain_decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=True,
                                clean_up_tokenization_spaces=False))


def finish_row(row: Row, row_number: int, reason: str, start: float,
               score: float | None = None) -> Iterator[Event]:
    """The Finish event, carrying any text still pending (`tail`); `score`: beam
    search's, for the hypothesis the row holds."""
    row.finished = True
    tail = ""
    if reason != "stop":
        tail = row.stops.feed(row.decoder.flush()) + row.stops.finish()
    yield Finish(row=row_number, prompt_index=row.prompt_index, reason=reason,
                 token_ids=tuple(row.ids), text=row.stops.final_text,
                 prompt_tokens=len(row.prompt_ids), start=start,
                 first_token=row.first_token, end=time.perf_counter(),
                 logprobs=tuple(row.logprobs), tail=tail, score=score)


def interrupt(events: Iterator[Event]) -> Iterator[Event]:
    """After Ctrl-C reached the consumer, let the generator finish its rows as
    "interrupted" and yield those events."""
    try:
        first = events.throw(KeyboardInterrupt())  # type: ignore[attr-defined]
    except (KeyboardInterrupt, StopIteration):
        return
    yield first
    yield from events


def collect(events: Iterator[Event], handle: Callable[[Event], None]
            ) -> tuple[list[Event], bool]:
    """Run an event stream to its end through `handle`, keeping Ctrl-C's events (see
    `interrupt`); (every event, whether Ctrl-C reached the consumer)."""
    seen: list[Event] = []
    try:
        for event in events:
            seen.append(event)
            handle(event)
    except KeyboardInterrupt:
        for event in interrupt(events):
            seen.append(event)
            handle(event)
        return seen, True
    return seen, False


def check_prompts(lm: LoadedModel, prompts: Sequence[Sequence[int]],
                  settings: GenerationSettings) -> None:
    """ConfigError / ContextLengthError / ModelLoadError (an id the model has no embedding
    for) / TooLargeError (rows that cannot fit in memory) for prompts no loop can run,
    before any work."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token, and this model's "
                          "tokenizer adds none (no BOS) to an empty prompt: give some text")
    for prompt in prompts:
        lm.check_fits(len(prompt), settings.max_new_tokens)
        lm.check_token_ids(prompt)
    check_memory(lm, rows_of(len(prompts), settings),
                 max(len(p) for p in prompts) + settings.max_new_tokens)


def context_of(prompts: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """The prompts as the processors' context (rows, length): left-padded with
    `processors.PAD`, which they ignore."""
    width = max(len(p) for p in prompts)
    rows = [[processors.PAD] * (width - len(p)) + list(p) for p in prompts]
    return torch.tensor(rows, dtype=torch.long, device=device)
