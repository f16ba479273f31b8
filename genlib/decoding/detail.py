"""Per-step detail of the decode loop, computed only when asked for (`Detail` on the
plan): each chosen token's log-probability under the raw model and under the processed
distribution it was sampled from, the top alternatives with both, and, for `explain`,
what every stage of the processor chain did to the distribution.

The stages are run here one at a time and the last one's output is the very tensor
the sampler draws from (`run_stages`), so the record shows the distribution that was
used, not a recomputation. Nothing here runs unless the plan asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from genlib.sampling import processors

RAW = "raw"
EOS_STAGE = "suppress_eos"


@dataclass(frozen=True)
class Detail:
    """What to record per step. `record`: whether to record at all (False: only the
    sampler choice below); `logprobs`: how many top alternatives (0-20) to keep;
    `stages`: also each stage's distribution (explain); `inverse_cdf`: sample by one
    uniform draw per row and step (common random numbers; the draw is recorded);
    `force`: {step: token id} to put in place of the sampled token (a branch), the
    step's draw still taken so later steps use the same random stream."""

    record: bool = True
    logprobs: int = 0
    stages: bool = False
    inverse_cdf: bool = False
    force: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One token at one step: `logprob` under the raw model, `processed_logprob` under
    the distribution sampled from (-inf when a stage removed it). With stages recorded:
    `stage_probs` (probability after raw, then each stage) and `removed_by`, the first
    stage that gave it probability 0 (None if it survived)."""

    token_id: int
    logprob: float
    processed_logprob: float
    rank: int
    stage_probs: tuple[float, ...] = ()
    removed_by: str | None = None


@dataclass(frozen=True, slots=True)
class StageEffect:
    """One stage's effect on a step: the probability mass it removed (under its input
    distribution), the tokens still possible and the entropy (nats) after it."""

    name: str
    removed_mass: float
    kept: int
    entropy: float


@dataclass(frozen=True, slots=True)
class StepDetail:
    """A chosen token's detail (see the module doc). `draw` is the uniform in [0, 1)
    the inverse-CDF sampler used (None otherwise); `interval` is the chosen token's span
    [lo, hi) of the processed cumulative distribution in vocabulary order, where the
    draw fell; `forced` marks a branch's token. `final` (stages recorded only) is the
    processed logits row the sampler drew from. `entropy`: of the distribution sampled
    from, nats."""

    chosen: Candidate
    top: tuple[Candidate, ...]
    entropy: float
    stages: tuple[StageEffect, ...] = ()
    draw: float | None = None
    interval: tuple[float, float] | None = None
    forced: bool = False
    final: torch.Tensor | None = None


def run_stages(chain: Sequence[processors.Stage], suppress: processors.Processor | None,
               context: torch.Tensor | None, logits: torch.Tensor
               ) -> list[tuple[str, torch.Tensor]]:
    """(name, logits after it) for raw, EOS suppression (when `suppress` is given), then
    each stage in order; the last entry is what the sampler draws from."""
    out = [(RAW, logits)]
    if suppress is not None:
        logits = suppress(context, logits)
        out.append((EOS_STAGE, logits))
    for stage in chain:
        logits = stage(context, logits)
        out.append((getattr(stage, "name", "stage"), logits))
    return out


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dimension (0 log 0 = 0); a one-token distribution's
    is 0.0, not the -0.0 the negation gives for p = 1."""
    return -(logp.exp() * logp).nan_to_num(0.0, 0.0, 0.0).sum(-1) + 0.0


def details(stages: list[tuple[str, torch.Tensor]], tokens: torch.Tensor,
            draws: torch.Tensor | None, want: Detail, forced: Sequence[bool]
            ) -> list[StepDetail]:
    """One StepDetail per row for the step whose stage outputs are `stages`."""
    raw = stages[0][1].float().log_softmax(-1)
    final_logits = stages[-1][1]
    final = final_logits.float().log_softmax(-1)
    stage_logps = [s.float().log_softmax(-1) for _, s in stages] if want.stages else []
    effects = _effects(stages, stage_logps) if want.stages else None
    top_n = max(want.logprobs, 1)
    top_ids = raw.topk(min(top_n, raw.shape[-1]), dim=-1).indices
    ranks = (raw > raw.gather(-1, tokens[:, None])).sum(-1)
    cdf = final.exp().cumsum(-1)
    entropies = entropy(final).clamp(min=0.0)
    out = []
    for i in range(tokens.shape[0]):
        tok = int(tokens[i])

        def candidate(t: int, rank: int, i: int = i) -> Candidate:
            return _candidate(i, t, rank, raw, final, stages, stage_logps)

        hi = float(cdf[i, tok])
        lo = hi - float(final[i, tok].exp())
        top = tuple(candidate(int(t), r) for r, t in enumerate(top_ids[i, :want.logprobs]))
        out.append(StepDetail(
            chosen=candidate(tok, int(ranks[i])), top=top, entropy=float(entropies[i]),
            stages=tuple(e[i] for e in effects) if effects else (),
            draw=None if draws is None else float(draws[i]), interval=(lo, hi),
            forced=forced[i], final=final_logits[i] if want.stages else None))
    return out


def _candidate(i: int, tok: int, rank: int, raw: torch.Tensor, final: torch.Tensor,
               stages: list[tuple[str, torch.Tensor]], stage_logps: list[torch.Tensor]
               ) -> Candidate:
    probs = tuple(float(lp[i, tok].exp()) for lp in stage_logps)
    removed = next((stages[k][0] for k, p in enumerate(probs) if p == 0.0), None)
    return Candidate(tok, float(raw[i, tok]), float(final[i, tok]), rank, probs, removed)


def _effects(stages: list[tuple[str, torch.Tensor]], logps: list[torch.Tensor]
             ) -> list[list[StageEffect]]:
    """Per stage, per row: mass removed (tokens alive before, -inf after), tokens kept,
    entropy after."""
    effects = []
    before = None
    for (name, logits), logp in zip(stages, logps):
        alive = logits > float("-inf")
        if before is None:
            removed = torch.zeros(logits.shape[0])
        else:
            gone = before[1] & ~alive
            removed = (before[0].exp() * gone).sum(-1)
        kept = alive.sum(-1)
        ent = entropy(logp).clamp(min=0.0)
        effects.append([StageEffect(name, float(removed[r]), int(kept[r]), float(ent[r]))
                        for r in range(logits.shape[0])])
        before = (logp, alive)
    return effects
