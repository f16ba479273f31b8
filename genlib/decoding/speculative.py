"""Speculative decoding: a cheap drafter proposes gamma tokens, the target scores all of
them in ONE forward pass and keeps a prefix, so each target forward yields 1 to gamma+1
tokens while the output follows exactly the target's own distribution.

    events = speculative_stream(target, target.encode("def f(x):"), settings,
                                draft_lm=draft, num_draft_tokens=5)
    # or, through genlib's one entry: genlib.generate.stream(..., drafter=Drafting(...))

Greedy: keep draft tokens while they equal the target's argmax; the first mismatch is
replaced by the target's token, so the output is the target's greedy output, token for
token. Sampling is speculative sampling (Leviathan, Kalman & Matias 2023, "Fast
Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2):
accept x ~ q with probability min(1, p(x)/q(x)); on rejection draw from
norm(max(0, p - q)); after a fully accepted block draw one bonus token from p. Here p and
q are the target's and drafter's distributions after the SAME processor chain
(penalties, temperature, top-k, top-p, ...), so the output follows the distribution
plain sampling with those settings gives.

Only one sequence (batch size 1) is supported. Events: the core's Prefill / Token
(with `draft` set) / Finish, plus one `Verify` per step; `summarize` turns them into the
acceptance and timing figures `genlab speculate` reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from genlib.backends.base import Backend
from genlib.backends.choose import (
    Request,
    check_draft_weights,
    choose_backend,
    draft_request,
)
from genlib.decoding import detail as stepdetail
from genlib.decoding import loop
from genlib.decoding.detail import RAW, Detail, StepDetail
from genlib.decoding.drafters import (
    Draft,
    Drafter,
    LookupFirstDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    check_same_vocabulary,
    prefill_all_but_last,
)
from genlib.decoding.step import (
    Plan,
    check_prompts,
    draft_bans,
    make_plan,
    new_row,
    process_logits,
    suppresses_eos,
)
from genlib.errors import ConfigError
from genlib.events import Event, Finish, Prefill, Token, Verify
from genlib.models.loading import LoadedModel
from genlib.sampling import draws as sampling
from genlib.sampling import grammar, processors
from genlib.settings.config import GenerationSettings

DEFAULT_DRAFT_TOKENS = 5  # draft model: transformers starts its heuristic higher (20)
DEFAULT_LOOKUP_TOKENS = 10  # prompt lookup drafts for free: transformers' usual 10
MAX_DRAFT_TOKENS = 64  # adaptive gamma never grows past this


@dataclass(frozen=True)
class Drafting:
    """Speculative decoding: a draft model (same vocabulary as the target), prompt
    lookup (the largest n-gram to match), or both (lookup first, `LookupFirstDrafter`).
    `num_draft_tokens` (gamma) defaults to 5 with a draft model and 10 for prompt lookup
    alone; `adaptive` grows/shrinks it per step (default: `adapts`); `draft_weights`:
    how the native kernel stores the draft model's matrices (`choose.draft_request`)."""

    draft_lm: LoadedModel | None = None
    prompt_lookup: int | None = None
    num_draft_tokens: int | None = None
    adaptive: bool | None = None
    draft_weights: str = "auto"


@dataclass
class Speculation:
    """One sequence being decoded speculatively. Invariant: `backend` caches the target's
    keys/values for ids[:-1]; the last committed token is fed by the next verify."""

    target: LoadedModel
    plan: Plan
    drafter: Drafter
    ids: list[int]
    backend: Backend
    prompt_len: int

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_len


@dataclass
class StepResult:
    """What one `speculative_step` committed."""

    tokens: list[int]
    from_draft: list[bool]
    logprobs: list[float]  # under the target's raw logits
    proposed: int
    accepted: int
    draft_seconds: float
    target_seconds: float
    draft_forwards: int
    details: list[StepDetail] | None = None  # per token, when the plan records them


@dataclass
class GammaSchedule:
    """How many tokens to draft next. Adaptive: +2 after a fully accepted block, -1 (not
    below 1) after a rejection, transformers' "heuristic" schedule for assisted decoding."""

    gamma: int
    adaptive: bool = False

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        if accepted == proposed:
            self.gamma = min(self.gamma + 2, MAX_DRAFT_TOKENS)
        else:
            self.gamma = max(1, self.gamma - 1)


def draft_length(num_draft_tokens: int | None, draft_model: bool) -> int:
    """Gamma to start with: as asked (0 too, which `check_request` refuses), else 5 with
    a draft model (lookup first or not) and 10 for prompt lookup alone."""
    if num_draft_tokens is not None:
        return num_draft_tokens
    return DEFAULT_DRAFT_TOKENS if draft_model else DEFAULT_LOOKUP_TOKENS


def adapts(adaptive: bool | None, draft_model: bool) -> bool:
    """Whether gamma adapts (`GammaSchedule`): as asked, else for a draft model only. A
    draft model's acceptance runs in long spells (boilerplate it predicts, then code it
    does not), which a fixed gamma cannot follow, so the schedule grows through the
    spells it predicts and shrinks after a rejection. Prompt lookup drafts for free, and
    keeps transformers' fixed 10."""
    return draft_model if adaptive is None else adaptive


def process(plan: Plan, context: Sequence[int], logits: torch.Tensor, step: int) -> torch.Tensor:
    """The core loop's processing of one position's logits (vocab,), as in
    `step.choose_tokens`: EOS suppression while step < min_new_tokens (or ignore_eos),
    then the settings' chain on the full context."""
    eos_now = plan.suppress_eos is not None and suppresses_eos(plan.settings, step)
    if not plan.chain and not eos_now:
        return logits
    ctx = (torch.tensor([list(context)], dtype=torch.long, device=logits.device)
           if plan.needs_context else None)
    return process_logits(plan.settings, plan.chain, plan.suppress_eos, ctx, logits[None],
                          step)[0]


def process_block(plan: Plan, ids: Sequence[int], drafted: Sequence[int],
                  logits: torch.Tensor, step: int) -> torch.Tensor:
    """`process` for a verify's positions at once: logits (k+1, vocab), position i's
    after ids + drafted[:i], at step + i. With no chain, and EOS suppressed at all of
    them or at none, the rows go through `process_logits` together."""
    last = step + len(logits) - 1
    same_eos = suppresses_eos(plan.settings, step) == suppresses_eos(plan.settings, last)
    if not plan.chain and same_eos:
        return process_logits(plan.settings, plan.chain, plan.suppress_eos, None, logits, step)
    return torch.stack([process(plan, [*ids, *drafted[:i]], logits[i], step + i)
                        for i in range(len(logits))])


def start(target: LoadedModel, backend: Backend, prompt_ids: Sequence[int], plan: Plan,
          drafter: Drafter) -> Speculation:
    """Prefill target and drafter with the prompt (all but its last token)."""
    capacity = len(prompt_ids) + plan.settings.max_new_tokens
    prefill_all_but_last(backend, prompt_ids, capacity)
    drafter.start(prompt_ids, capacity)
    return Speculation(target, plan, drafter, list(prompt_ids), backend, len(prompt_ids))


def speculative_step(spec: Speculation, gamma: int) -> StepResult:
    """Draft up to `gamma` tokens, score them with one target forward, keep the accepted
    prefix plus one target token; roll both caches back past the first rejection."""
    plan = spec.plan
    generator = plan.generators[0] if plan.generators else None
    base = spec.generated

    def draft_process(context: Sequence[int], logits: torch.Tensor, i: int) -> torch.Tensor:
        return process(plan, context, logits, base + i)

    draft = _grammar_valid(plan, spec, spec.drafter.propose(
        spec.ids, gamma, draft_process, generator, draft_bans(plan, base, gamma)))
    begin = time.perf_counter()
    fed = [spec.ids[-1], *draft.tokens]
    raw = spec.backend.extend(torch.tensor(
        [fed], dtype=torch.long, device=spec.target.device))[0]  # (k+1, vocab)
    p_logits = process_block(plan, spec.ids, draft.tokens, raw, base)
    if plan.settings.do_sample:
        accepted, last = verify_sampled(p_logits.softmax(dim=-1), draft, generator)
    else:
        accepted, last = verify_greedy(p_logits, draft.tokens)
    tokens = [*draft.tokens[:accepted], last]
    logprobs = raw[:len(tokens)].log_softmax(dim=-1).gather(
        -1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(-1).tolist()
    details = _details(plan, raw, p_logits, tokens) if plan.records else None
    spec.ids.extend(tokens)
    spec.backend.crop(len(spec.ids) - 1)
    target_seconds = time.perf_counter() - begin
    spec.drafter.commit(spec.ids)
    return StepResult(tokens, [True] * accepted + [False], logprobs, len(draft.tokens),
                      accepted, draft.seconds, target_seconds, draft.forwards, details)


def _details(plan: Plan, raw: torch.Tensor, p_logits: torch.Tensor, tokens: list[int]
             ) -> list[StepDetail]:
    """Per committed token: its record under the target's raw logits and `p`, the
    processed distribution every committed token follows (speculative sampling's
    guarantee), position by position."""
    assert plan.detail is not None
    n = len(tokens)
    stages = [(RAW, raw[:n]), ("processed", p_logits[:n])]
    chosen = torch.tensor(tokens, device=raw.device)
    return stepdetail.details(stages, chosen, None, plan.detail, [False] * n)


def _grammar_valid(plan: Plan, spec: Speculation, draft: Draft) -> Draft:
    """The draft cut before its first token the grammar forbids (if any): the target's
    processed p gives such a token probability 0, so verification would reject it anyway,
    and it is cheaper not to score it (greedy output is unchanged, sampled output keeps
    its distribution)."""
    matchers = processors.grammar_of(plan.chain)
    if matchers is None or not draft.tokens:
        return draft
    keep = grammar.valid_prefix(matchers, spec.ids[spec.prompt_len:], draft.tokens)
    if keep == len(draft.tokens):
        return draft
    return replace(draft, tokens=draft.tokens[:keep],
                   q=draft.q[:keep] if draft.q is not None else None)


def verify_greedy(p_logits: torch.Tensor, drafted: Sequence[int]) -> tuple[int, int]:
    """(accepted, next token): keep drafts equal to the target's argmax; the first that
    differs is replaced by the argmax, and after a full block the argmax is the bonus."""
    best = p_logits.argmax(dim=-1).tolist()
    for i, x in enumerate(drafted):
        if x != best[i]:
            return i, best[i]
    return len(drafted), best[len(drafted)]


def verify_sampled(p: torch.Tensor, draft: Draft, generator: torch.Generator | None
                   ) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    p: the target's processed distributions (k+1, vocab), q: the drafter's (k, vocab), or
    one-hot when the drafter is deterministic. Accept draft x_i with probability
    min(1, p_i(x)/q_i(x)); on the first rejection draw from norm(max(0, p_i - q_i));
    if all k are accepted, draw the bonus token from p_{k+1}.
    """
    for i, x in enumerate(draft.tokens):
        q_i = draft.q[i] if draft.q is not None else _one_hot(x, p.shape[-1], p.device)
        r = torch.rand((), generator=generator, device=p.device)
        if r * q_i[x] < p[i, x]:  # r < min(1, p(x)/q(x)), without dividing by q(x)
            continue
        return i, sampling.draw(_residual(p[i], q_i), generator)
    k = len(draft.tokens)
    return k, sampling.draw(p[k], generator)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)). A rejection implies p(x) < q(x) somewhere, hence mass
    elsewhere; only rounding can leave none, and then p itself is the right law."""
    diff = (p - q).clamp(min=0)
    total = diff.sum()
    return diff / total if total > 0 else p


def _one_hot(x: int, size: int, device: torch.device) -> torch.Tensor:
    q = torch.zeros(size, device=device)
    q[x] = 1.0
    return q


def make_drafter(target: LoadedModel, settings: GenerationSettings, *,
                 draft_lm: LoadedModel | None, prompt_lookup: int | None,
                 backend: str = "auto", draft_weights: str = "auto") -> Drafter:
    """The drafter asked for: a draft model (its vocabulary checked by `check_request`)
    on the backend `choose_backend` picks for it under the user's `backend`, its
    matrices stored as `draft_weights` says (`choose.draft_request`), prompt lookup, or
    both, lookup first."""
    if draft_lm is None and prompt_lookup is None:
        raise ConfigError("speculative decoding needs a drafter: a draft model "
                          "(--draft-model), prompt lookup (--prompt-lookup N), or both")
    if prompt_lookup is not None and prompt_lookup < 1:
        raise ConfigError(f"--prompt-lookup is the n-gram size to match, >= 1; "
                          f"got {prompt_lookup}")
    check_draft_weights(draft_weights, draft_lm is not None)
    lookup = PromptLookupDrafter(prompt_lookup) if prompt_lookup is not None else None
    if draft_lm is None:
        assert lookup is not None
        return lookup
    draft_backend = choose_backend(draft_lm, draft_request(draft_lm, backend, draft_weights))
    model = ModelDrafter(draft_lm, draft_backend, sample=settings.do_sample)
    return LookupFirstDrafter(lookup, model) if lookup is not None else model


def check_request(target: LoadedModel, prompt_ids: Sequence[int], settings: GenerationSettings,
                  draft_lm: LoadedModel | None, num_draft_tokens: int) -> None:
    """ConfigError / ContextLengthError / ModelLoadError for what speculation cannot do,
    before any work (a draft fed the target's tokens would fail on a smaller vocabulary)."""
    if settings.strategy == "beam":
        raise ConfigError("speculative decoding does greedy or sampling, not beam search; "
                          "use `genlab beam` for beams")
    if settings.mirostat:
        raise ConfigError("mirostat adapts after every token it samples; speculative "
                          "decoding verifies several at once: drop mirostat")
    if settings.num_return_sequences > 1:
        raise ConfigError(f"speculative decoding supports one sequence at a time (batch "
                          f"size 1); got num_return_sequences={settings.num_return_sequences}")
    if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"--num-draft-tokens must be 1 to {MAX_DRAFT_TOKENS}, got "
                          f"{num_draft_tokens}")
    check_prompts(target, [prompt_ids], settings)
    if draft_lm is not None:
        check_same_vocabulary(target, draft_lm)
        draft_lm.check_fits(len(prompt_ids), settings.max_new_tokens,
                            whose=f"the draft model {draft_lm.ref}'s",
                            remedy="use a draft with a longer context (or --prompt-lookup N)")


def speculative_stream(target_lm: LoadedModel, prompt_ids: Sequence[int],
                       settings: GenerationSettings, *, draft_lm: LoadedModel | None = None,
                       prompt_lookup: int | None = None, num_draft_tokens: int | None = None,
                       adaptive: bool | None = None, backend: str = "auto",
                       detail: Detail | None = None, draft_weights: str = "auto"
                       ) -> Iterator[Event]:
    """Decode one prompt speculatively; yield Prefill, then per step a Verify and its
    Token events (draft=True for accepted draft tokens, False for the target's own),
    then Finish. Stopping, detokenization and processing are the core loop's.

    Give `draft_lm` (same vocabulary as the target), `prompt_lookup` (the largest n-gram
    to match), or both (lookup first, the draft model where it finds no match).
    `num_draft_tokens` (gamma) defaults to 5 with a draft model and 10 for prompt lookup
    alone; `adaptive` grows/shrinks it per step (default: `adapts`,
    for a draft model only). `backend` is the
    user's choice for both models (--backend; auto: each model's fastest exact one).
    `draft_weights`: how the native kernel stores the draft model's matrices (auto:
    bfloat16 where the draft runs on it; `choose.draft_request`).
    """
    gamma = draft_length(num_draft_tokens, draft_lm is not None)
    check_request(target_lm, prompt_ids, settings, draft_lm, gamma)
    drafter = make_drafter(target_lm, settings, draft_lm=draft_lm, prompt_lookup=prompt_lookup,
                           backend=backend, draft_weights=draft_weights)
    target = choose_backend(target_lm, Request(rows=1, crop=True, backend=backend))
    plan = make_plan(target_lm, settings, 1, prompt_width=len(prompt_ids), detail=detail)
    row = new_row(target_lm, 0, prompt_ids, settings)
    schedule = GammaSchedule(gamma, adapts(adaptive, draft_lm is not None))
    yield from loop.run(target_lm, target, plan, [row], Speculative(target_lm, drafter, schedule))


def speculate(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
           drafting: Drafting, backend: str = "auto", detail: Detail | None = None
           ) -> Iterator[Event]:
    """`speculative_stream` for `genlib.generate.stream`: one prompt, `drafting`'s drafter."""
    if len(prompts) != 1:
        raise ConfigError(f"speculative decoding runs one prompt at a time, got {len(prompts)}")
    yield from speculative_stream(lm, prompts[0], settings, draft_lm=drafting.draft_lm,
                                  prompt_lookup=drafting.prompt_lookup,
                                  num_draft_tokens=drafting.num_draft_tokens,
                                  adaptive=drafting.adaptive, backend=backend,
                                  detail=detail, draft_weights=drafting.draft_weights)


class Speculative:
    """Speculative decoding's step (a `loop.Stepper`), one row: draft up to gamma tokens,
    verify them with one target forward, commit the accepted ones and the target's own
    (`speculative_step`). The verify feeds the tokens itself, so the loop's forward has
    nothing to run; the step's `Verify` event comes before its tokens."""

    def __init__(self, target: LoadedModel, drafter: Drafter, schedule: GammaSchedule
                 ) -> None:
        self.target, self.drafter, self.schedule = target, drafter, schedule
        self.spec: Speculation | None = None

    @property
    def draft_weights(self) -> str | None:
        return self.drafter.draft_weights

    def prefill(self, backend: Backend, plan: Plan, prompts: Sequence[Sequence[int]],
                capacity: int) -> None:
        [prompt] = prompts
        self.spec = start(self.target, backend, prompt, plan, self.drafter)

    def choose(self, backend: Backend, plan: Plan, context: torch.Tensor | None,
               logits: torch.Tensor | None, step: int) -> loop.Chosen:
        spec = self.spec
        assert spec is not None
        # The verify commits up to gamma + 1 tokens: never draft past the budget.
        room = plan.settings.max_new_tokens - spec.generated
        result = speculative_step(spec, min(self.schedule.gamma, room - 1))
        self.schedule.update(result.proposed, result.accepted)
        verify = Verify(0, result.proposed, result.accepted, result.draft_seconds,
                        result.target_seconds, result.draft_forwards, time.perf_counter())
        details = result.details or [None] * len(result.tokens)
        return loop.Chosen([list(zip(result.tokens, result.logprobs, details, result.from_draft))],
                      events=(verify,))

    def forward(self, backend: Backend, tokens: torch.Tensor) -> None:
        raise AssertionError("a speculative step feeds its own tokens")

    def interrupted(self) -> None:
        return None


@dataclass
class Summary:
    """Acceptance and timing figures of one speculative run, from its events alone."""

    new_tokens: int = 0
    steps: int = 0  # target forwards (verifies)
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0  # steps whose block was not fully accepted
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    draft_forwards: int = 0
    decode_seconds: float = 0.0  # end of prefill to finish
    prefill_seconds: float = 0.0
    by_position: list[list[int]] = field(default_factory=list)  # [proposed, accepted] per i
    gammas: list[int] = field(default_factory=list)  # tokens proposed, per step

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (what llama.cpp and vLLM print)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability alpha of Leviathan et al., estimated as
        accepted / (accepted + rejections): drafts after a rejection are never tested."""
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target forward (1 = no gain from drafting)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per target forward."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def mean_gamma(self) -> float:
        return sum(self.gammas) / len(self.gammas) if self.gammas else 0.0

    @property
    def cost_ratio(self) -> float:
        """c: seconds per draft forward / seconds per target forward (0 for lookup)."""
        if not self.draft_forwards or not self.steps or not self.target_seconds:
            return 0.0
        return (self.draft_seconds / self.draft_forwards) / (self.target_seconds / self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def verify_cost(self, plain_tps: float) -> float:
        """Seconds per verify forward / seconds per plain decoding step (plain decoding at
        `plain_tps` tokens/s): the formula takes this as 1, which holds where a forward is
        memory-bound (GPUs), less so on a CPU. 0.0 before any step."""
        return self.target_seconds / self.steps * plain_tps if self.steps else 0.0

    def predicted_speedup(self, verify_cost: float = 1.0) -> float:
        """Leviathan et al. 2023, Theorem 3.8 / eq. (1) with the measured alpha and c,
        summed over the steps taken with their own gamma: the expected tokens
        (1 - alpha^(gamma+1)) / (1 - alpha) over the costs, in target forwards: one a
        step, plus c for each draft forward the step ran (gamma c + 1 with a draft
        model; 1 for a step prompt lookup drafted, lookup first or alone).

        The formula takes a target forward over gamma+1 tokens to cost one plain decoding
        step. Pass `verify_cost` (measured verify seconds / plain step seconds) where that
        is not so (CPUs): c is measured against the verify forward, so the whole
        per-block cost scales by it and the prediction divides by it."""
        if not self.gammas:
            return 0.0
        # gamma varies per step (adaptive, or lookup finding shorter or no matches): sum
        # the formula's expected tokens and costs over the steps actually taken.
        tokens = sum(expected_tokens(self.alpha, g) for g in self.gammas)
        cost = self.steps + self.draft_forwards * self.cost_ratio
        return tokens / cost / verify_cost


def predicted_speedup(alpha: float, gamma: float, c: float) -> float:
    """Expected wall-time speed-up over plain decoding (Leviathan et al. 2023, eq. 1):
    (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1)


def expected_tokens(alpha: float, gamma: float) -> float:
    """Tokens one step yields: (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan eq. 1)."""
    return gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def summarize(events: Iterable[Event]) -> Summary:
    """Fold a speculative run's events into a Summary."""
    s = Summary()
    prefill_end = None
    for event in events:
        if isinstance(event, Prefill):
            prefill_end, s.prefill_seconds = event.time, event.seconds
        elif isinstance(event, Verify):
            _add_verify(s, event)
        elif isinstance(event, Token):
            s.new_tokens += 1
        elif isinstance(event, Finish) and prefill_end is not None:
            s.decode_seconds = event.end - prefill_end
    return s


def _add_verify(s: Summary, v: Verify) -> None:
    s.steps += 1
    s.proposed += v.proposed
    s.accepted += v.accepted
    s.rejections += v.accepted < v.proposed
    s.draft_seconds += v.draft_seconds
    s.target_seconds += v.target_seconds
    s.draft_forwards += v.draft_forwards
    s.gammas.append(v.proposed)
    while len(s.by_position) < v.proposed:
        s.by_position.append([0, 0])
    for i in range(v.proposed):
        s.by_position[i][0] += 1
        s.by_position[i][1] += i < v.accepted


__all__ = ["DEFAULT_DRAFT_TOKENS", "DEFAULT_LOOKUP_TOKENS", "GammaSchedule", "Speculation",
           "StepResult", "Summary", "predicted_speedup", "process", "speculative_step",
           "speculative_stream", "start", "summarize", "verify_greedy", "verify_sampled"]
