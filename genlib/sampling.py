"""Samplers: `(logits, generator) -> token_ids`. Greedy is the argmax sampler. Seeds
follow `genlib.config`'s seed policy (`fresh_seed`, `derive_seed`, `row_seeds`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Sampler = Callable[[torch.Tensor, "torch.Generator | None"], torch.Tensor]


def greedy(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """argmax over the last dimension."""
    return logits.argmax(dim=-1)


def multinomial(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """x ~ softmax(logits), drawn with the given generator."""
    probs = logits.float().softmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def pick_sampler(do_sample: bool) -> Sampler:
    return multinomial if do_sample else greedy


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
