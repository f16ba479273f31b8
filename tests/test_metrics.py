"""genlib.lab.metrics on hand-made token sequences whose values are worked out by hand."""

from __future__ import annotations

import math

import pytest

from genlib.lab import metrics


def test_ngrams_in_order():
    assert metrics.ngrams([1, 2, 3], 2) == [(1, 2), (2, 3)]
    assert metrics.ngrams([1, 2], 3) == []
    with pytest.raises(ValueError):
        metrics.ngrams([1], 0)


def test_distinct_n():
    # unigrams 1,2,1,2: 2 unique of 4; bigrams (1,2),(2,1),(1,2): 2 unique of 3
    assert metrics.distinct_n([1, 2, 1, 2], 1) == 0.5
    assert metrics.distinct_n([1, 2, 1, 2], 2) == pytest.approx(2 / 3)
    assert metrics.distinct_n([1, 2, 3, 4], 3) == 1.0
    assert metrics.distinct_n([1, 2], 3) is None


def test_repeated_4gram_once():
    # 4-grams: 1234 2341 3412 4123 1234 -> only the last occurred earlier: 1/5
    assert metrics.repeated_ngram_rate([1, 2, 3, 4, 1, 2, 3, 4], 4) == pytest.approx(0.2)


def test_repeated_4gram_loop_and_none():
    loop = [5, 6, 7] * 4  # 9 four-grams, 3 distinct: the other 6 are repeats
    assert metrics.repeated_ngram_rate(loop, 4) == pytest.approx(6 / 9)
    assert metrics.repeated_ngram_rate(list(range(20)), 4) == 0.0
    assert metrics.repeated_ngram_rate([1, 2, 3], 4) is None


def test_repeated_rate_is_one_minus_distinct():
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 3, 1, 4, 1, 5, 9, 2]
    for n in (1, 2, 3, 4):
        assert metrics.repeated_ngram_rate(ids, n) == pytest.approx(
            1 - metrics.distinct_n(ids, n))


def test_mean_logprob_and_perplexity():
    half = math.log(0.5)
    assert metrics.mean_logprob([half, half]) == pytest.approx(half)
    assert metrics.perplexity([half, half]) == pytest.approx(2.0)
    # p = 1/2 and 1/8: mean logprob -2 ln 2, perplexity 4
    assert metrics.perplexity([half, math.log(0.125)]) == pytest.approx(4.0)
    assert metrics.mean_logprob([]) is None
    assert metrics.perplexity([]) is None


def test_jaccard_distance():
    # bigrams {12, 23} and {12, 24}: 1 shared of 3
    assert metrics.jaccard_distance([1, 2, 3], [1, 2, 4], 2) == pytest.approx(2 / 3)
    assert metrics.jaccard_distance([1], [2], 2) is None


def test_pairwise_diversity():
    assert metrics.pairwise_diversity([[1, 2, 3], [1, 2, 3]]) == 0.0
    assert metrics.pairwise_diversity([[1, 2, 3], [4, 5, 6]]) == 1.0
    assert metrics.pairwise_diversity([[1, 2, 3]]) is None
    # pairs: (a, a) 0, (a, b) 1, (a, b) 1 -> mean 2/3
    a, b = [1, 2, 3], [7, 8, 9]
    assert metrics.pairwise_diversity([a, a, b]) == pytest.approx(2 / 3)


def test_first_difference_and_agreement():
    assert metrics.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert metrics.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_difference([1, 2], [1, 2, 3]) == 2
    assert metrics.agreement([1, 2, 3], [1, 9, 3, 4]) == pytest.approx(2 / 4)
    assert metrics.agreement([], []) is None


def test_sample_set_metrics_averages_and_diversity():
    a, b = [1, 2, 3, 4, 1, 2, 3, 4], list(range(10, 18))
    half = math.log(0.5)
    summary = metrics.sample_set_metrics([a, b], [[half] * 8, [math.log(0.25)] * 8])
    assert summary["new_tokens"] == 8.0
    assert summary["repeated_4gram"] == pytest.approx((0.2 + 0.0) / 2)
    assert summary["perplexity"] == pytest.approx((2.0 + 4.0) / 2)
    assert summary["diversity"] == 1.0
    assert metrics.sample_set_metrics([a], [[half] * 8])["diversity"] is None


def test_best_values_follow_each_direction():
    rows = [{"perplexity": 2.0, "distinct_2": 0.5, "new_tokens": 10.0, "diversity": None},
            {"perplexity": 3.0, "distinct_2": 0.9, "new_tokens": 20.0, "diversity": 0.4}]
    best = metrics.best_values(rows)
    assert best["perplexity"] == 2.0
    assert best["distinct_2"] == 0.9
    assert best["diversity"] == 0.4
    assert "new_tokens" not in best  # no direction: never highlighted
