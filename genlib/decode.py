"""genlib's decode loop: prefill once, then one token per step against the KV cache,
yielding typed events (`genlib.events`). Greedy and sampling share this one loop;
greedy is just the argmax sampler.

    events = stream(lm, [lm.encode("Once upon a time")], settings)
    for event in events: ...

Batches of prompts of different lengths are left-padded; each row stops on its own
(end id, token budget, stop string, time) and leaves the batch when it does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from genlib import forward, grammar, processors, sampling
from genlib.config import GenerationSettings
from genlib.detok import IncrementalDecoder
from genlib.errors import ConfigError
from genlib.events import Event, Finish, Prefill, Token
from genlib.models import LoadedModel
from genlib.stopping import StopStrings


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
    suppress_eos: processors.Processor | None
    needs_context: bool
    seeds: list[int]


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
    base = settings.seed if settings.seed is not None else sampling.fresh_seed()
    return [base if i == 0 else sampling.derive_seed(base, i) for i in range(rows)]


def make_plan(lm: LoadedModel, settings: GenerationSettings, rows: int,
              seeds: Sequence[int] | None = None, prompt_width: int = 0) -> Plan:
    """`prompt_width`: the context columns that hold the (left-padded) prompts."""
    constraint = grammar.compile_for(lm.tokenizer, lm.vocab_size, lm.eos_ids, settings)
    chain = processors.build_processors(settings, prompt_width=prompt_width,
                                        tokenizer=lm.tokenizer, constraint=constraint)
    suppress = suppress_eos_for(lm, settings)
    all_seeds = row_seeds(settings, rows, seeds)
    generators = ([sampling.make_generator(s, lm.device) for s in all_seeds]
                  if settings.do_sample else None)
    return Plan(settings=settings, chain=chain, sampler=sampling.pick_sampler(settings.do_sample),
                generators=generators, suppress_eos=suppress, needs_context=bool(chain),
                seeds=all_seeds)


def suppress_eos_for(lm: LoadedModel, settings: GenerationSettings
                     ) -> processors.Processor | None:
    """The EOS-suppressing processor `process_logits` applies while `min_new_tokens` or
    `ignore_eos` say so; None when neither can apply."""
    if (settings.ignore_eos or settings.min_new_tokens) and lm.eos_ids:
        return processors.suppress_tokens(lm.eos_ids)
    return None


def process_logits(settings: GenerationSettings, chain: Sequence[processors.Processor],
                   suppress_eos: processors.Processor | None, context: torch.Tensor | None,
                   logits: torch.Tensor, step: int) -> torch.Tensor:
    """One step's logits (rows, vocab) as every loop processes them (decode, beam,
    speculative): EOS suppressed before `min_new_tokens` (or throughout with
    `ignore_eos`), then the settings' processor chain."""
    if suppress_eos is not None and (settings.ignore_eos or step < settings.min_new_tokens):
        logits = suppress_eos(context, logits)
    return processors.apply(chain, context, logits)


def choose_tokens(plan: Plan, context: torch.Tensor | None, logits: torch.Tensor, step: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Process the logits, pick one token per row; return (tokens, model logprobs)."""
    processed = process_logits(plan.settings, plan.chain, plan.suppress_eos, context, logits,
                               step)
    tokens = sampling.sample_rows(plan.sampler, processed, plan.generators)
    processors.observe(plan.chain, processed, tokens)
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def stream(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
           *, seeds: Sequence[int] | None = None, compile: bool = False) -> Iterator[Event]:
    """Generate for every prompt (`num_return_sequences` rows each); yield events.

    `seeds` gives each row its own sampling seed (default: derived from settings.seed).
    A single row runs through `forward.prefill_row`: the lean forward where the model
    allows it, its steps torch.compile'd with `compile` (same tokens, faster per step;
    the first call compiles), else a static compiled cache with `compile`; batches of
    several rows keep the dynamic cache. Beam search runs `genlib.beam`'s loop, which
    has no compiled path (ConfigError with `compile`).
    On KeyboardInterrupt thrown into the generator (see `interrupt`), the rows still
    running finish with reason "interrupted".
    """
    if settings.strategy == "beam" and compile:
        raise ConfigError("--compile runs greedy and sampling decoding; beam search has no "
                          "compiled path: drop --compile")
    expanded_rows = len(prompts) * settings.num_return_sequences
    if settings.strategy == "beam" or expanded_rows > 1:
        lm.load_model_now()  # beams and batches run on transformers' forward
    if settings.strategy == "beam":
        from genlib import beam  # beam search has its own loop over the same forward pass

        yield from beam.stream(lm, prompts, settings, seeds=seeds)
        return
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token")
    for prompt in prompts:
        lm.check_fits(len(prompt), settings.max_new_tokens)
    expanded = expand_prompts(prompts, settings.num_return_sequences)
    plan = make_plan(lm, settings, len(expanded), seeds, max(len(p) for p in prompts))
    single_token_texts: dict[int, str] = {}
    rows = [new_row(lm, i, ids, settings, single_token_texts) for i, ids in expanded]
    yield from _decode_loop(lm, plan, rows, compile)


def _prefill(lm: LoadedModel, input_ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
             compile: bool) -> tuple[torch.Tensor, forward.KVState]:
    """Prefill a single row through `forward.prefill_row` (the lean forward, or a static
    compiled cache with `compile`); a batch into a dynamic cache."""
    if input_ids.shape[0] == 1:
        logits, state = forward.prefill_row(lm, input_ids, input_ids.shape[1] + new_tokens,
                                            compile=compile)
        assert logits is not None  # prompts are never empty here
        return logits, state
    return forward.prefill(lm.model, input_ids, mask)


def _decode_loop(lm: LoadedModel, plan: Plan, rows: list[Row], compile: bool = False
                 ) -> Iterator[Event]:
    settings = plan.settings
    start = time.perf_counter()
    deadline = start + settings.max_time if settings.max_time else None
    input_ids, mask = forward.left_pad([r.prompt_ids for r in rows], lm.pad_id, lm.device)
    active = list(range(len(rows)))  # batch position -> row number
    try:
        logits, state = _prefill(lm, input_ids, mask, settings.max_new_tokens, compile)
        context = input_ids.masked_fill(mask == 0, processors.PAD) if plan.needs_context \
            else None
        yield Prefill(tuple(len(r.prompt_ids) for r in rows), time.perf_counter() - start,
                      time.perf_counter())
        for step in range(settings.max_new_tokens):
            tokens, logprobs = choose_tokens(plan, context, logits, step)
            now = time.perf_counter()
            done: list[int] = []
            # One host read per step for tokens and logprobs together (token ids < 2**24
            # are exact in float32): on a GPU each read is a synchronisation.
            picked = torch.stack([tokens.float(), logprobs.float()]).tolist()
            for pos, (tok, lp) in enumerate(zip(map(int, picked[0]), picked[1])):
                row = rows[active[pos]]
                event, reason = advance(lm, row, active[pos], tok, lp, step, now)
                if event is not None:
                    yield event
                if reason is None and deadline is not None and now >= deadline:
                    reason = "time"
                if reason is None and step + 1 == settings.max_new_tokens:
                    reason = "length"
                if reason is not None:
                    reason = grammar.finish_reason(processors.grammar_of(plan.chain), row.ids,
                                                   reason)
                    yield from finish_row(row, active[pos], reason, start)
                    done.append(pos)
            if len(done) == len(active):
                return
            keep = _drop_rows(state, plan, active, done, lm.device) if done else None
            if keep is not None:
                tokens = tokens.index_select(0, keep)
                context = context.index_select(0, keep) if context is not None else None
            if context is not None:
                context = torch.cat([context, tokens[:, None]], dim=1)
            logits = forward.extend(state, tokens[:, None])[:, -1, :]
    except KeyboardInterrupt:
        for row_number in active:
            if not rows[row_number].finished:
                yield from finish_row(rows[row_number], row_number, "interrupted", start)


def advance(lm: LoadedModel, row: Row, row_number: int, token: int, logprob: float,
             step: int, now: float) -> tuple[Token | None, str | None]:
    """Record one token for a row; return its event and a finish reason (or None)."""
    row.ids.append(token)
    row.logprobs.append(logprob)
    if row.first_token is None:
        row.first_token = now
    is_eos = token in lm.eos_ids and not row.stops.stopped
    text = row.stops.feed(row.decoder.push(token))
    event = Token(row_number, token, text, logprob, step, now)
    if row.stops.stopped:
        return event, "stop"
    if is_eos:
        return event, "eos"
    return event, None


def finish_row(row: Row, row_number: int, reason: str, start: float) -> Iterator[Event]:
    """The Finish event, carrying any text still pending (`tail`)."""
    row.finished = True
    tail = ""
    if reason != "stop":
        tail = row.stops.feed(row.decoder.flush()) + row.stops.finish()
    yield Finish(row=row_number, prompt_index=row.prompt_index, reason=reason,
                 token_ids=tuple(row.ids), text=row.stops.final_text,
                 prompt_tokens=len(row.prompt_ids), start=start,
                 first_token=row.first_token, end=time.perf_counter(),
                 logprobs=tuple(row.logprobs), tail=tail)


def _drop_rows(state: forward.KVState, plan: Plan, active: list[int], done: list[int],
               device: torch.device) -> torch.Tensor:
    """Remove finished rows from the batch (cache, mask, generators); return kept indices."""
    finished = set(done)
    keep = [pos for pos in range(len(active)) if pos not in finished]
    index = torch.tensor(keep, dtype=torch.long, device=device)
    state.reorder(index)
    processors.reorder(plan.chain, index)
    if plan.generators is not None:
        plan.generators = [plan.generators[p] for p in keep]
    active[:] = [active[p] for p in keep]
    return index


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


def generate(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
             *, seeds: Sequence[int] | None = None) -> list[Finish]:
    """Run `stream` to the end; the Finish events in row order."""
    finished = [e for e in stream(lm, prompts, settings, seeds=seeds) if isinstance(e, Finish)]
    return sorted(finished, key=lambda f: f.row)
