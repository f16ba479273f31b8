"""Pure metrics over generated token ids and their log-probabilities.

Everything here works on plain sequences of ints/floats (no torch), so the metrics are
easy to check by hand. N-grams are taken over token ids, not words: two outputs of the
same tokenizer are compared exactly, with no word splitting to argue about.

References:
- distinct-n: Li et al., 2016, "A Diversity-Promoting Objective Function for Neural
  Conversation Models" (unique n-grams / all n-grams).
- repeated n-gram rate: the `seq-rep-n` of Welleck et al., 2019, "Neural Text
  Degeneration with Unlikelihood Training" (1 - unique n-grams / all n-grams).
- self-BLEU: Zhu et al., 2018, "Texygen: A Benchmarking Platform for Text Generation
  Models"; here replaced by the simpler pairwise n-gram Jaccard distance, which needs
  no smoothing choices and reads the same way (higher = samples differ more).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


def ngrams(ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """Every n-gram of `ids`, in order (len(ids) - n + 1 of them, or none)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]


def distinct_n(ids: Sequence[int], n: int) -> float | None:
    """distinct-n = |unique n-grams| / |n-grams|; None when the text has no n-gram."""
    grams = ngrams(ids, n)
    if not grams:
        return None
    return len(set(grams)) / len(grams)


def repeated_ngram_rate(ids: Sequence[int], n: int = 4) -> float | None:
    """Fraction of the n-grams of `ids` that already occurred earlier in `ids`.

    Position i counts as repeated when ids[i:i+n] equals ids[j:j+n] for some j < i.
    This equals 1 - distinct-n (Welleck et al.'s seq-rep-n): 0 for text that never
    repeats an n-gram, close to 1 for a loop. None when the text has no n-gram.
    """
    grams = ngrams(ids, n)
    if not grams:
        return None
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for gram in grams:
        repeated += gram in seen
        seen.add(gram)
    return repeated / len(grams)


def mean_logprob(logprobs: Sequence[float]) -> float | None:
    """Mean log-probability per token (nats) of an output under the model; None if empty."""
    if not logprobs:
        return None
    return math.fsum(logprobs) / len(logprobs)


def perplexity(logprobs: Sequence[float]) -> float | None:
    """exp(-mean logprob): the model's perplexity on its own output; None if empty."""
    mean = mean_logprob(logprobs)
    return None if mean is None else math.exp(-mean)


def jaccard_distance(a: Sequence[int], b: Sequence[int], n: int) -> float | None:
    """1 - |A ∩ B| / |A ∪ B| over the n-gram sets A, B; None if both have no n-gram."""
    set_a, set_b = set(ngrams(a, n)), set(ngrams(b, n))
    union = set_a | set_b
    if not union:
        return None
    return 1.0 - len(set_a & set_b) / len(union)


def pairwise_diversity(samples: Sequence[Sequence[int]], n: int = 2) -> float | None:
    """Mean n-gram Jaccard distance over all pairs of samples.

    0 when every sample is identical, 1 when no two samples share an n-gram. None with
    fewer than two samples (diversity across one sample is undefined).
    """
    distances = [d for a, b in itertools.combinations(samples, 2)
                 if (d := jaccard_distance(a, b, n)) is not None]
    if not distances:
        return None
    return math.fsum(distances) / len(distances)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (a length difference counts);
    None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(a: Sequence[int], b: Sequence[int]) -> float | None:
    """Position-wise agreement: matching positions / the longer length (a missing
    position counts as a disagreement); None when both are empty."""
    longest = max(len(a), len(b))
    if longest == 0:
        return None
    return sum(x == y for x, y in zip(a, b)) / longest


@dataclass(frozen=True)
class Metric:
    """How one metric is named and which direction is better (None: neither)."""

    key: str
    label: str
    higher_is_better: bool | None
    fmt: str = ".3f"


METRICS: tuple[Metric, ...] = (
    Metric("new_tokens", "new tokens", None, ".1f"),
    Metric("seconds", "time (s)", False, ".2f"),
    Metric("tokens_per_s", "tokens/s", True, ".1f"),
    Metric("mean_logprob", "mean logprob", True),
    Metric("perplexity", "perplexity", False, ".2f"),
    Metric("distinct_1", "distinct-1", True),
    Metric("distinct_2", "distinct-2", True),
    Metric("distinct_3", "distinct-3", True),
    Metric("repeated_4gram", "repeated 4-grams", False),
    Metric("diversity", "diversity (samples)", True),
)
"""Every metric `compare` reports, in display order. Lower perplexity means the model
found the text more likely, not that it is better writing: it is marked best in the
sense of "most probable", as greedy and beam aim for."""


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return math.fsum(present) / len(present) if present else None


def text_metrics(ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, float | None]:
    """The per-output metrics of one sample (keys as in METRICS)."""
    return {
        "new_tokens": float(len(ids)),
        "mean_logprob": mean_logprob(logprobs),
        "perplexity": perplexity(logprobs),
        "distinct_1": distinct_n(ids, 1),
        "distinct_2": distinct_n(ids, 2),
        "distinct_3": distinct_n(ids, 3),
        "repeated_4gram": repeated_ngram_rate(ids, 4),
    }


def sample_set_metrics(samples: Sequence[Sequence[int]],
                       logprobs: Sequence[Sequence[float]]) -> dict[str, float | None]:
    """Per-output metrics averaged over samples, plus `diversity` across them.

    Perplexity is exp(-mean logprob) of each sample, then averaged, so every sample
    weighs the same whatever its length.
    """
    per_sample = [text_metrics(ids, lps) for ids, lps in zip(samples, logprobs)]
    keys = per_sample[0].keys() if per_sample else text_metrics((), ()).keys()
    summary = {key: _mean([m[key] for m in per_sample]) for key in keys}
    summary["diversity"] = pairwise_diversity(samples, 2)
    return summary


def best_values(rows: Sequence[dict[str, float | None]]) -> dict[str, float]:
    """For each metric with a direction, the best value among `rows` (absent if none)."""
    best: dict[str, float] = {}
    for metric in METRICS:
        if metric.higher_is_better is None:
            continue
        values = [r[metric.key] for r in rows if r.get(metric.key) is not None]
        if values:
            best[metric.key] = max(values) if metric.higher_is_better else min(values)
    return best
