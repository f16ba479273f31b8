"""Samplers: `(logits, generator) -> token_ids`. Greedy is the argmax sampler. Seeds
follow `genlib.settings.config`'s seed policy (`fresh_seed`, `derive_seed`, `row_seeds`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from genlib.errors import ConfigError

Sampler = Callable[[torch.Tensor, "torch.Generator | None"], torch.Tensor]


def greedy(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """argmax over the last dimension."""
    return logits.argmax(dim=-1)


def multinomial(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """x ~ softmax(logits), drawn with the given generator."""
    probs = finite(logits.float().softmax(dim=-1))
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def uniform(generator: torch.Generator | None, shape: tuple[int, ...] = (),
            device: torch.device | None = None, dtype: torch.dtype = torch.float32
            ) -> torch.Tensor:
    """u ~ U[0, 1) drawn with `generator`: exactly one draw per element, whatever the
    distribution, so two runs from one seed share their draws (common random numbers)."""
    if generator is not None:
        device = generator.device
    return torch.rand(shape, generator=generator, device=device, dtype=dtype)


def pick_by_uniform(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first token (vocabulary order) whose cumulative probability
    exceeds u * total; tokens of probability 0 have empty spans and are never picked."""
    cdf = logits.float().softmax(dim=-1).cumsum(dim=-1)
    finite(cdf[..., -1])  # a NaN or infinite weight makes its row's total NaN or inf
    return _first_past(cdf, u)


def finite(probs: torch.Tensor) -> torch.Tensor:
    """`probs`, or a ConfigError when a setting pushed the processed logits past float32's
    range: their softmax is then NaN, which no sampler can draw from."""
    if not bool(torch.isfinite(probs).all()):
        raise ConfigError(OVERFLOW)
    return probs


OVERFLOW = ("the settings push the logits past float32's range, so there is no "
            "distribution to sample: a temperature or repetition_penalty too close to 0 or "
            "past 3e38, or a logit_bias too large; keep temperature and repetition_penalty "
            "between 1e-4 and 1e4, and logit_bias within +-1e4")


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token x ~ probs (vocab,) (weights: any scale) by inverse CDF, from one uniform
    draw, where torch.multinomial draws an exponential per token: speculative
    sampling's drafter and verify draw with it, several times a step. The sums and the
    draw are float64 (but on Apple's MPS, which has none): in float32 a span under
    ~6e-8 (a token that unlikely, near the end of the sum) is lost or widened to the
    spacing of the numbers, in float64 to ~1e-16. NaN or infinite weights raise `finite`'s
    ConfigError; negative or all-zero ones ValueError, as torch.multinomial raises."""
    wide = torch.float32 if probs.device.type == "mps" else torch.float64
    cdf = probs.to(wide).cumsum(dim=-1)
    total = float(cdf[-1])
    if not math.isfinite(total):  # `finite`'s test on a float: `finite` on the 0-d
        raise ConfigError(OVERFLOW)  # tensor would add a sizeable share to a draw
    if not 0.0 < total or float(probs.min()) < 0.0:
        raise ValueError(f"cannot draw from these weights (sum {total}): they must be "
                         "finite, not negative, and not all zero")
    return int(_first_past(cdf, uniform(generator, (), probs.device, wide)))


def _first_past(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    target = (u.to(cdf.device) * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Rounding can put u * total past the last positive span: take the last token
    # with positive probability (never a removed one).
    last = (cdf < cdf[..., -1:]).sum(-1)
    return torch.minimum(index, last)


def inverse_cdf(logits: torch.Tensor, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """x ~ softmax(logits) by inverse-CDF sampling: one uniform draw per row."""
    return pick_by_uniform(logits, uniform(generator, tuple(logits.shape[:-1]), logits.device))


def pick_sampler(do_sample: bool, crn: bool = False) -> Sampler:
    """The sampler: argmax without sampling; with it, multinomial, or inverse-CDF
    sampling when `crn` (common random numbers) asks for one uniform per step."""
    if not do_sample:
        return greedy
    return inverse_cdf if crn else multinomial


def sample_rows(sampler: Sampler, logits: torch.Tensor,
                generators: Sequence[torch.Generator] | None) -> torch.Tensor:
    """Sample each row with its own generator, so a row's draws do not depend on which
    other rows share its batch."""
    if sampler is greedy or not generators:
        return sampler(logits, None)
    if len(generators) == 1:
        return sampler(logits, generators[0])
    return torch.stack([sampler(logits[i], g) for i, g in enumerate(generators)])


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
