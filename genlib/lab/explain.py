"""`explain`: step through one generation and keep, per step, what the processor chain
did (`genlib.decoding.detail`), consuming the one event stream (`genlib.generate.stream`).

Sampling runs by inverse CDF (one uniform draw per step, recorded), so the record says
where the draw fell and a branch (`force`) can continue with the same draws after the
forced step: a counterfactual whose only difference is the token put in its place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genlib.decoding.detail import Candidate, Detail, StepDetail
from genlib.decoding.detok import token_bytes, token_text
from genlib.errors import ConfigError
from genlib.events import Finish, Token
from genlib.models.loading import LoadedModel
from genlib.sampling.processors import GRAMMAR_STAGE
from genlib.settings.config import GenerationSettings

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Run:
    """One explained generation: its Token events (each with its `detail`) and Finish."""

    tokens: tuple[Token, ...]
    finish: Finish | None

    @property
    def ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


def explain(lm: LoadedModel, prompt_ids: Sequence[int], settings: GenerationSettings,
            *, top: int = 5, force: Mapping[int, int] | None = None,
            backend: str = "auto") -> Run:
    """Generate for one prompt recording every step (top `top` alternatives, each
    stage's distribution); `force` = {step: token id} makes a branch; `backend`, the
    user's choice (--backend). Only the first output row is explained (a preset's
    num_return_sequences is set to 1)."""
    from genlib.generate import stream

    detail = Detail(logprobs=top, stages=True, inverse_cdf=settings.do_sample,
                    force=dict(force or {}))
    tokens: list[Token] = []
    finish: Finish | None = None
    settings = settings.replace(num_return_sequences=1)
    for event in stream(lm, [list(prompt_ids)], settings, detail=detail, backend=backend):
        if isinstance(event, Token):
            check_forced(lm, event)  # before the stream computes the step after it
            tokens.append(event)
        elif isinstance(event, Finish):
            finish = event
    return Run(tuple(tokens), finish)


def check_forced(lm: LoadedModel, t: Token) -> None:
    """ConfigError for a branch token the grammar forbids at its step: the grammar then
    allows no next token, and the branch would go on outside it."""
    if t.detail is not None and t.detail.forced and \
            t.detail.chosen.removed_by == GRAMMAR_STAGE:
        raise ConfigError(
            f"the branch's token {token_text(lm.tokenizer, t.token_id)!r} (id {t.token_id}) is not "
            f"allowed by the grammar at step {t.index}; force one it allows there (a "
            f"candidate whose grammar probability is above 0)")


def divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first step where two token sequences differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def runs_of(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """An explain document's runs by name: the original and, with a branch, the branch."""
    return {"original": record["original"],
            **({"branch": record["branch"]} if "branch" in record else {})}


def branch_outcome(branch: dict[str, Any]) -> str:
    """What a branch record (the `branch` of an explain document) did: "ended" (the run
    stopped before its step, so nothing was forced), "same" (it forced the token the
    original chose there) or "diverged" (at `diverges_at`)."""
    if len(branch["steps"]) <= branch["step"]:
        return "ended"
    return "same" if branch["diverges_at"] is None else "diverged"


def parse_branch(lm: LoadedModel, step: str, token: str, max_new_tokens: int, *,
                 usage: str, name: str, limit: str) -> tuple[int, int]:
    """A branch point, (step, token id), from its two parts as typed. ConfigError with
    `usage` (how the caller writes one) when the step is not a number or the token is
    missing; naming the caller (`name`) and what sets max_new_tokens there (`limit`)
    when the step is past it."""
    if not step.isdigit() or not token.strip():
        raise ConfigError(usage)
    if int(step) >= max_new_tokens:
        raise ConfigError(f"{name} step {step} is past {limit} ({max_new_tokens}); steps "
                          f"count from 0")
    return int(step), parse_token(lm, token.strip())


def parse_token(lm: LoadedModel, text: str) -> int:
    """A branch's TOKEN: an id (digits, or `#id`) or a text that is exactly one token
    (tried as is and with a leading space, as a word inside a sentence)."""
    raw = text[1:] if text.startswith("#") else text
    if raw.isdigit():
        tid = int(raw)
        if tid >= lm.vocab_size:
            raise ConfigError(f"token id {tid} is outside the vocabulary (0-{lm.vocab_size - 1})")
        return tid
    for candidate in (text, " " + text):
        ids = lm.tokenizer.encode(candidate, add_special_tokens=False)
        if len(ids) == 1:
            return int(ids[0])
        if len(ids) == 2 and candidate.startswith(" ") and \
                lm.tokenizer.decode(ids[:1]).strip() == "":
            return int(ids[1])
    raise ConfigError(f"{text!r} is not one token of this model; give a token id "
                      "instead (explain's --json lists each step's candidates with ids)")


def _num(x: float) -> float | None:
    """JSON has no -inf/nan: None stands for a probability of 0."""
    return None if math.isinf(x) or math.isnan(x) else round(x, 6)


def _prob(p: float) -> float:
    """A probability to 6 significant digits: rounding to 6 decimals would write a
    small one that a stage kept (temperature 0.3 makes many) as 0, a removed token's."""
    return float(f"{p:.6g}")


def candidate_dict(lm: LoadedModel, c: Candidate, stage_names: Sequence[str]
                   ) -> dict[str, Any]:
    """One candidate as JSON, in the OpenAI/vLLM logprobs shape plus genlab's keys."""
    text = token_text(lm.tokenizer, c.token_id)
    out: dict[str, Any] = {"token": text, "id": c.token_id,
                           "bytes": token_bytes(lm.tokenizer, c.token_id, text),
                           "logprob": _num(c.logprob),
                           "processed_logprob": _num(c.processed_logprob), "rank": c.rank}
    if c.stage_probs:
        out["stage_probs"] = {n: _prob(p) for n, p in zip(stage_names, c.stage_probs)}
        out["removed_by"] = c.removed_by
    return out


def logprobs_content(lm: LoadedModel, tokens: Sequence[Token]) -> dict[str, Any]:
    """The OpenAI/vLLM `logprobs` object for a row's Token events: `content[i]` has the
    token, its raw `logprob`, its `processed_logprob` and `top_logprobs` (raw top-N)."""
    content = []
    for t in tokens:
        d: StepDetail = t.detail
        entry = candidate_dict(lm, d.chosen, ())
        entry["top_logprobs"] = [candidate_dict(lm, c, ()) for c in d.top]
        content.append(entry)
    return {"content": content}


def step_dict(lm: LoadedModel, t: Token) -> dict[str, Any]:
    """One explained step as JSON."""
    d: StepDetail = t.detail
    names = [s.name for s in d.stages]
    return {
        "step": t.index, "token": t.text, **{"chosen": candidate_dict(lm, d.chosen, names)},
        "forced": d.forced, "draw": d.draw,
        "interval": [round(x, 6) for x in d.interval] if d.interval else None,
        "stages": [{"name": s.name, "removed_mass": _prob(s.removed_mass), "kept": s.kept,
                    "entropy": round(s.entropy, 6)} for s in d.stages],
        "candidates": [candidate_dict(lm, c, names) for c in d.top],
    }


# (model ref, its log-probabilities (steps, vocab)) per combined model, the main one first
ModelLogprobs = list[tuple[str, "torch.Tensor"]]


def run_dict(lm: LoadedModel, run: Run, per_model: ModelLogprobs | None = None
             ) -> dict[str, Any]:
    """A Run as the `explain --json` record's `steps` plus its text and finish; with
    `per_model` (combined models), each candidate's probability under each model."""
    f = run.finish
    steps = [step_dict(lm, t) for t in run.tokens]
    for i, step in enumerate(steps if per_model else []):
        for candidate in [step["chosen"], *step["candidates"]]:
            candidate["model_probs"] = {
                ref: _prob(math.exp(float(logprobs[i, candidate["id"]])))
                for ref, logprobs in per_model or ()}
    return {"text": f.text if f else "".join(t.text for t in run.tokens),
            "token_ids": run.ids, "finish_reason": f.reason if f else None, "steps": steps}


def model_logprobs(lm: LoadedModel, settings: GenerationSettings,
                   prompt_ids: Sequence[int], run: Run, backend: str = "auto"
                   ) -> ModelLogprobs | None:
    """Each combined model's own log-probabilities at every step of `run` ((steps,
    vocab) each, the main model first), fed the run's tokens on the backend the user's
    `backend` gives it; None where `settings` combine no models."""
    import torch

    from genlib.backends.choose import Request, choose_backend
    from genlib.sampling.combine import combination_of

    combination = combination_of(lm, settings)
    if combination is None or not run.ids:
        return None
    out: ModelLogprobs = []
    for model in combination.models:
        stepped = choose_backend(model, Request(backend=backend))
        rows = [stepped.prefill([list(prompt_ids)], len(prompt_ids) + len(run.ids))]
        rows += [stepped.step(torch.tensor([token])) for token in run.ids[:-1]]
        assert rows[0] is not None  # a prompt has at least one token
        out.append((model.ref, torch.cat(rows).float().log_softmax(-1)))
    return out
