"""genlib.sampling.draws's draws: each follows its distribution and never picks a token of
probability 0."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from genlib.errors import ConfigError
from genlib.sampling.draws import draw


def test_draw_follows_the_probabilities_and_skips_removed_tokens() -> None:
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    generator = torch.Generator().manual_seed(0)
    n = 20000
    counts = Counter(draw(probs, generator) for _ in range(n))
    assert counts[1] == counts[4] == 0
    observed = torch.tensor([counts[i] / n for i in range(5)])
    assert (observed - probs).abs().max() < 0.0125  # 3.5 standard errors at p = 0.5


def test_draw_takes_unnormalized_weights_and_is_seeded() -> None:
    weights = torch.tensor([0.0, 2.0, 6.0])  # a speculative residual before normalizing
    first = [draw(weights, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert first[0] == first[1]
    generator = torch.Generator().manual_seed(1)
    counts = Counter(draw(weights, generator) for _ in range(8000))
    assert counts[0] == 0 and abs(counts[2] / 8000 - 0.75) < 0.017


def test_draw_gives_each_of_a_long_tail_of_unlikely_tokens_its_own_span(monkeypatch) -> None:
    """8,000 tokens of probability 1e-9 after a likely one. Sums near 1 kept in float32
    are 6e-8 apart, so most of these tokens would get no span and a few a span 60 times
    their probability; draw's float64 gives each its own."""
    from genlib.sampling import draws as sampling

    head = 1.0 - 8e-6
    probs = torch.cat([torch.tensor([head], dtype=torch.float64),
                       torch.full((8000,), 1e-9, dtype=torch.float64)])
    for j in (0, 1, 17, 4000, 7999):  # a u inside tail token j's span picks it
        u = torch.tensor(head + (j + 0.5) * 1e-9, dtype=torch.float64)
        asked: list[torch.dtype] = []
        monkeypatch.setattr(sampling, "uniform",
                            lambda *args, u=u, asked=asked: asked.append(args[-1]) or u)
        assert draw(probs, None) == 1 + j
        assert asked == [torch.float64]  # a float32 uniform has 2^-24 steps


@pytest.mark.parametrize("weights", [[0.0, 0.0, 0.0], [0.5, -0.1, 0.6]])
def test_draw_refuses_weights_no_distribution_has(weights) -> None:
    with pytest.raises(ValueError, match="cannot draw from these weights"):
        draw(torch.tensor(weights), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("weights", [[0.5, float("nan"), 0.5], [0.2, float("inf"), 0.3]])
def test_draw_says_which_settings_give_weights_that_are_not_numbers(weights) -> None:
    """NaN or infinite weights come from settings past float32's range (sampling.finite)."""
    with pytest.raises(ConfigError, match="past float32's range"):
        draw(torch.tensor(weights), torch.Generator().manual_seed(0))
