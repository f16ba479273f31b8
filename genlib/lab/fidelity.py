"""How far a quantized format moves a model's predictions: held-out text through the
float32 matrices and through each format on the native kernel, every position's
next-token distribution compared.

    report = fidelity(lean, token_ids, ("q8_0", "nf4", "q4_0"))
    report["q8_0"].perplexity, report["q8_0"].top1_agreement, report["q8_0"].mean_kl

The text runs in windows of `window` tokens (a model trained on 256-token windows
degrades past them), each from an empty cache; every position but a window's last
predicts the next token. Per format: perplexity (exp of the mean negative log-likelihood
of the next tokens), top-1 agreement (the share of positions whose argmax is float32's)
and the mean KL divergence KL(p_float32 || p_format) in nats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from genlib.backends.kernel import NativeStep


@dataclass(frozen=True)
class Fidelity:
    """One format's figures over the text, against float32's."""

    weights: str
    positions: int
    perplexity: float
    top1_agreement: float
    mean_kl: float

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "positions": self.positions,
                "perplexity": self.perplexity, "top1_agreement": self.top1_agreement,
                "mean_kl": self.mean_kl}


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


def fidelity(lean: Any, tokens: Sequence[int], formats: Sequence[str], window: int = 256,
             threads: int | None = None) -> dict[str, Fidelity]:
    """float32's and each of `formats`' figures (the module doc), by name; float32's
    agreement is 1 and its divergence 0."""
    threads = threads or torch.get_num_threads()
    names = ["float32", *[f for f in formats if f != "float32"]]
    steps = {name: NativeStep(lean, threads, weights=name) for name in names}
    nll = dict.fromkeys(names, 0.0)
    kl, agree = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    positions = 0
    for piece in windows(tokens, window):
        target = torch.tensor(piece[1:])
        reference = window_logprobs(steps["float32"], lean, piece)
        best = reference.argmax(-1)
        for name in names:
            logprobs = reference if name == "float32" else \
                window_logprobs(steps[name], lean, piece)
            nll[name] -= float(logprobs.gather(1, target[:, None]).sum())
            kl[name] += float((reference.exp() * (reference - logprobs)).sum())
            agree[name] += int((logprobs.argmax(-1) == best).sum())
        positions += len(piece) - 1
    if not positions:
        raise ValueError("the text has fewer than two tokens: nothing to predict")
    return {name: Fidelity(name, positions, float(torch.tensor(nll[name] / positions).exp()),
                           agree[name] / positions, kl[name] / positions) for name in names}
