"""Logits processors: pure functions `(token_ids, logits) -> logits`, built once by
`build_processors` into an ordered list of named `Stage`s and run by `apply`.

The default order (`DEFAULT_ORDER`; EOS suppression runs before it, per step):

    penalties -> no_repeat_ngram -> temperature -> top_k -> top_p -> min_p -> typical_p

(the order of transformers' `generate()`, so distributions match it). `settings.samplers`
(`--samplers`) gives another order, as llama.cpp's `--samplers` does; stage names are that
option's vocabulary (`STAGE_NAMES`). Sampling-only stages (`SAMPLING_STAGES`) are skipped
for greedy and beam search, where they could not change the argmax anyway. `token_ids`
is the full context, prompt included, shape (batch, length); left-padding positions hold
-1 and are ignored. No processor modifies its input in place.

A stateful stage (Mirostat) keeps per-row state in `Stage.state`: its function only reads
that state, so a stage can be run again for inspection without effect; the loop calls
`observe` with the sampled tokens once per step (which updates the state) and `reorder`
when rows leave the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from genlib.config import GenerationSettings

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PAD = -1
NEG_INF = float("-inf")

# Every stage name, in the default order (the `--samplers` vocabulary).
DEFAULT_ORDER: tuple[str, ...] = (
    "penalties", "no_repeat_ngram",
    "temperature", "top_k", "top_p", "min_p", "typical_p",
)
STAGE_NAMES = frozenset(DEFAULT_ORDER)
# Stages that only shape a distribution to sample from: skipped without sampling.
SAMPLING_STAGES = frozenset({"temperature", "top_k", "top_p", "min_p", "typical_p"})


class RowState(Protocol):
    """Per-row state of a stateful stage (one entry per batch row)."""

    def observe(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Update from the logits sampled from (rows, vocab) and the tokens drawn (rows,)."""

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the rows at `index`, in that order (rows left the batch or beams moved)."""


@dataclass(frozen=True)
class Stage:
    """One named step of the chain: `fn(token_ids, logits) -> logits`, pure (it may read,
    never write, `state`)."""

    name: str
    fn: Processor
    state: RowState | None = None

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return self.fn(token_ids, logits)


def suppress_tokens(ids: Sequence[int]) -> Processor:
    index = torch.tensor(list(ids), dtype=torch.long)

    def suppress(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """suppress: logit[id] = -inf for the given ids (min_new_tokens, ignore_eos)."""
        return logits.index_fill(-1, index.to(logits.device), NEG_INF)

    return suppress


def repetition_penalty(penalty: float) -> Processor:
    def repeat(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """repetition penalty (CTRL): seen token's logit l -> l/p if l > 0 else l*p."""
        ids = torch.where(token_ids < 0, token_ids[:, -1:], token_ids)
        seen = logits.gather(-1, ids)
        seen = torch.where(seen < 0, seen * penalty, seen / penalty)
        return logits.scatter(-1, ids, seen)

    return repeat


def no_repeat_ngram(n: int) -> Processor:
    def no_repeat(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """no-repeat-ngram: ban x if (last n-1 tokens, x) already occurs in the context."""
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, ids in enumerate(token_ids.tolist()):
            ids = [t for t in ids if t >= 0]
            if len(ids) + 1 < n:
                continue
            tail = tuple(ids[len(ids) - n + 1:]) if n > 1 else ()
            for start in range(len(ids) - n + 1):
                if tuple(ids[start:start + n - 1]) == tail:
                    banned_rows.append(row)
                    banned_ids.append(ids[start + n - 1])
        if not banned_rows:
            return logits
        out = logits.clone()
        out[banned_rows, banned_ids] = NEG_INF
        return out

    return no_repeat


def temperature(t: float) -> Processor:
    def scale(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """temperature: l -> l / T."""
        return logits / t

    return scale


def top_k(k: int) -> Processor:
    def keep_top_k(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """top-k: drop tokens whose logit is below the k-th largest (ties kept)."""
        kth = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, NEG_INF)

    return keep_top_k


def top_p(p: float) -> Processor:
    def nucleus(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """top-p: keep the most probable tokens whose total probability reaches p."""
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        return logits.masked_fill(drop, NEG_INF)

    return nucleus


def min_p(p: float) -> Processor:
    def keep_min_p(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """min-p: drop tokens with p < min_p * p_max."""
        probs = logits.softmax(dim=-1)
        threshold = p * probs.amax(dim=-1, keepdim=True)
        return logits.masked_fill(probs < threshold, NEG_INF)

    return keep_min_p


def typical_p(mass: float) -> Processor:
    def typical(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """typical-p: keep tokens whose surprise is closest to the entropy, up to `mass`."""
        logp = logits.log_softmax(dim=-1)
        entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
        distance = (-logp - entropy).abs()
        sorted_distance, order = torch.sort(distance, descending=False)
        cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < mass).sum(dim=1).clamp(max=logits.shape[-1] - 1)
        drop_sorted = sorted_distance > sorted_distance.gather(1, last.view(-1, 1))
        drop_sorted[..., :1] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        return logits.masked_fill(drop, NEG_INF)

    return typical


def _stage_fn(name: str, settings: GenerationSettings) -> Processor | None:
    """The processor for stage `name` under `settings`; None when the stage is off."""
    s = settings
    if name == "penalties":
        return repetition_penalty(s.repetition_penalty) if s.repetition_penalty != 1.0 \
            else None
    if name == "no_repeat_ngram":
        return no_repeat_ngram(s.no_repeat_ngram_size) if s.no_repeat_ngram_size > 0 else None
    if name == "temperature":
        return temperature(s.temperature) if s.temperature != 1.0 else None
    if name == "top_k":
        return top_k(s.top_k) if s.top_k > 0 else None
    if name == "top_p":
        return top_p(s.top_p) if s.top_p < 1.0 else None
    if name == "min_p":
        return min_p(s.min_p) if s.min_p > 0.0 else None
    if name == "typical_p":
        return typical_p(s.typical_p) if s.typical_p < 1.0 else None
    raise ValueError(f"unknown stage {name!r}")


def stage_order(settings: GenerationSettings) -> tuple[str, ...]:
    """The order the chain runs in: `settings.samplers` if given, else `DEFAULT_ORDER`."""
    return tuple(getattr(settings, "samplers", ())) or DEFAULT_ORDER


def build_processors(settings: GenerationSettings) -> list[Stage]:
    """The chain for `settings`: its active stages, in the order used (EOS suppression
    is added per step by the decode loop, not here)."""
    chain: list[Stage] = []
    for name in stage_order(settings):
        if name in SAMPLING_STAGES and not settings.do_sample:
            continue
        fn = _stage_fn(name, settings)
        if fn is not None:
            chain.append(Stage(name, fn))
    return chain


def apply(chain: Sequence[Processor], token_ids: torch.Tensor, logits: torch.Tensor
          ) -> torch.Tensor:
    """Run the chain's stages in order."""
    for processor in chain:
        logits = processor(token_ids, logits)
    return logits


def observe(chain: Sequence[Processor], logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """After sampling: let stateful stages see the logits sampled from and the tokens."""
    for stage in chain:
        state = getattr(stage, "state", None)
        if state is not None:
            state.observe(logits, tokens)


def reorder(chain: Sequence[Processor], index: torch.Tensor) -> None:
    """Rows left the batch (or beams moved): keep stateful stages' rows at `index`."""
    for stage in chain:
        state = getattr(stage, "state", None)
        if state is not None:
            state.reorder(index)
