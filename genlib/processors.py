"""Logits processors: pure functions `(token_ids, logits) -> logits`, built once by
`build_processors` and run in one documented order:

    suppress-EOS -> repetition penalty -> no-repeat-ngram -> temperature -> top-k
    -> top-p -> min-p -> typical-p

(the order of transformers' `generate()`, so distributions match it). Sampling-only
processors (temperature onwards) are skipped for greedy and beam search, where they
could not change the argmax anyway. `token_ids` is the full context, prompt included,
shape (batch, length); left-padding positions hold -1 and are ignored. No processor
modifies its input in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from genlib.config import GenerationSettings

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PAD = -1
NEG_INF = float("-inf")


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


def build_processors(settings: GenerationSettings) -> list[Processor]:
    """The processor chain for `settings`, in the documented order (EOS suppression is
    added per step by the decode loop, not here)."""
    chain: list[Processor] = []
    if settings.repetition_penalty != 1.0:
        chain.append(repetition_penalty(settings.repetition_penalty))
    if settings.no_repeat_ngram_size > 0:
        chain.append(no_repeat_ngram(settings.no_repeat_ngram_size))
    if settings.do_sample:
        if settings.temperature != 1.0:
            chain.append(temperature(settings.temperature))
        if settings.top_k > 0:
            chain.append(top_k(settings.top_k))
        if settings.top_p < 1.0:
            chain.append(top_p(settings.top_p))
        if settings.min_p > 0.0:
            chain.append(min_p(settings.min_p))
        if settings.typical_p < 1.0:
            chain.append(typical_p(settings.typical_p))
    return chain


def apply(chain: Sequence[Processor], token_ids: torch.Tensor, logits: torch.Tensor
          ) -> torch.Tensor:
    for processor in chain:
        logits = processor(token_ids, logits)
    return logits
