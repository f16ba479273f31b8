"""How far a quantized format moves a model's predictions: held-out text through the
float32 matrices and through each format on the native kernel, every position's
next-token distribution compared.

    report = fidelity(lean, token_ids, ("q8_0", "nf4", "q4_0"))
    report["q8_0"].perplexity, report["q8_0"].top1_agreement, report["q8_0"].mean_kl

The text runs in windows of `window` tokens (a model trained on 256-token windows
degrades past them), each from an empty cache; every position but a window's last
predicts the next token. Per format: perplexity (exp of the mean negative log-likelihood
of the next tokens), top-1 agreement (the share of positions whose argmax is float32's)
and the mean KL divergence KL(p_float32 || p_format) in nats; and the standard error of
the perplexity's ratio to float32's, with the windows as the sampled units (positions
within a window are not independent): a difference within two of it is noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from genlib.backends.kernel import NativeStep

# A window's token ids -> the log-probabilities (len - 1, vocab) of each next token.
Scorer = Callable[[list[int]], torch.Tensor]


@dataclass(frozen=True)
class Fidelity:
    """One format's figures over the text, against float32's."""

    weights: str
    positions: int
    perplexity: float
    top1_agreement: float
    mean_kl: float
    # The standard error of the perplexity's ratio to float32's, the windows as the
    # sampled units (`Tally.difference`); None with a single window.
    perplexity_error: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "positions": self.positions,
                "perplexity": self.perplexity, "top1_agreement": self.top1_agreement,
                "mean_kl": self.mean_kl, "perplexity_error": self.perplexity_error}


def windows(tokens: Sequence[int], window: int) -> list[list[int]]:
    """`tokens` in consecutive windows of `window` (the last may be shorter); a window of
    one token predicts nothing and is dropped."""
    cut = [list(tokens[i:i + window]) for i in range(0, len(tokens), window)]
    return [w for w in cut if len(w) > 1]


def window_logprobs(step: NativeStep, lean: Any, tokens: list[int]) -> torch.Tensor:
    """Log-probabilities (len - 1, vocab) of the next token at each position but the
    last, from an empty cache."""
    cache = lean.new_cache(len(tokens))
    logits = step.extend(tokens[:-1], cache)
    return torch.log_softmax(logits.double(), dim=-1)


@dataclass
class Tally:
    """One format's running sums over the windows, against float32's log-probabilities;
    `window_nll` keeps each window's summed negative log-likelihood (for a paired error
    between two formats, window by window)."""

    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    positions: int = 0
    window_nll: list[float] = field(default_factory=list)
    window_sizes: list[int] = field(default_factory=list)

    def add(self, reference: torch.Tensor, logprobs: torch.Tensor, target: torch.Tensor
            ) -> None:
        """One window: `reference` and `logprobs` (positions, vocab), `target` the next
        token at each position."""
        nll = -float(logprobs.gather(1, target[:, None]).sum())
        self.nll += nll
        self.window_nll.append(nll)
        self.window_sizes.append(len(target))
        self.kl += float((reference.exp() * (reference - logprobs)).sum())
        self.agree += int((logprobs.argmax(-1) == reference.argmax(-1)).sum())
        self.positions += len(target)

    def difference(self, other: Tally) -> tuple[float, float]:
        """The mean negative log-likelihood a position here, less `other`'s over the same
        windows (the log of the perplexities' ratio), and its standard error with the
        windows as the sampled units (positions within a window are not independent)."""
        if len(self.window_nll) != len(other.window_nll) or len(self.window_nll) < 2:
            raise ValueError("a paired difference needs the same two or more windows")
        sizes = torch.tensor(self.window_sizes, dtype=torch.float64)
        gaps = torch.tensor(self.window_nll, dtype=torch.float64) - \
            torch.tensor(other.window_nll, dtype=torch.float64)
        mean = float(gaps.sum() / sizes.sum())
        count = len(sizes)
        spread = float(((gaps - mean * sizes) ** 2).sum()) * count / (count - 1)
        return mean, spread ** 0.5 / float(sizes.sum())

    def figures(self, name: str, reference: Tally | None = None) -> Fidelity:
        """The figures over the windows so far; with `reference` (float32's tally), the
        perplexity's standard error against it too."""
        if not self.positions:
            raise ValueError("the text has fewer than two tokens: nothing to predict")
        error = None
        if reference is not None and len(self.window_nll) > 1:
            gap, spread = self.difference(reference)
            error = math.exp(gap) * spread  # of exp(gap), to first order
        return Fidelity(name, self.positions, math.exp(self.nll / self.positions),
                        self.agree / self.positions, self.kl / self.positions, error)


def tally(pieces: Sequence[list[int]], scorers: dict[str, Scorer]) -> dict[str, Tally]:
    """Each scorer's tally over `pieces`, against the first scorer's (the reference)."""
    tallies = {name: Tally() for name in scorers}
    for piece in pieces:
        target = torch.tensor(piece[1:])
        reference = None
        for name, score in scorers.items():
            logprobs = score(piece)
            reference = logprobs if reference is None else reference
            tallies[name].add(reference, logprobs, target)
    return tallies


def native_scorers(lean: Any, formats: Sequence[str], threads: int | None = None
                   ) -> dict[str, Scorer]:
    """float32's scorer, then each of `formats`', on the native kernel."""
    threads = threads or torch.get_num_threads()
    names = ["float32", *[f for f in formats if f != "float32"]]
    steps = {name: NativeStep(lean, threads, weights=name) for name in names}
    return {name: partial(window_logprobs, step, lean) for name, step in steps.items()}


def fidelity(lean: Any, tokens: Sequence[int], formats: Sequence[str], window: int = 256,
             threads: int | None = None) -> dict[str, Fidelity]:
    """float32's and each of `formats`' figures (the module doc), by name; float32's
    agreement is 1 and its divergence 0."""
    tallies = tally(windows(tokens, window), native_scorers(lean, formats, threads))
    return {name: t.figures(name, tallies["float32"]) for name, t in tallies.items()}
