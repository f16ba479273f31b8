"""Token-level combinations of models that share a tokenizer: an ensemble's weighted
mixture or product of experts, and contrastive decoding's expert against an amateur.

Each combination turns the models' next-token logits into one row of log-scores that the
decode loops take as the logits of a single model (`genlib.backends.combined`), so every
sampler, constraint, beam search and batch applies to the combined distribution.

- `mean` (a mixture): log sum_i w_i p_i.
- `product` (a product of experts, Hinton 2002): log_softmax(sum_i w_i log p_i).
- contrastive decoding (Li et al. 2023, in the form of O'Brien and Lewis 2023):
  (1 + beta) log p_expert - beta log p_amateur over the plausible tokens
  V_head = {t : p_expert(t) >= alpha * max p_expert}, -inf elsewhere.

Ensemble weights are normalised to sum to 1. The settings say which combination runs
(`ensemble_mode`, `cd_beta`, `cd_alpha`); the models come from the run's flags, held as
`Partner`s on the main model (`LoadedModel.partners`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from genlib.errors import ConfigError

if TYPE_CHECKING:
    from genlib.models.info import LoadedModel
    from genlib.settings.config import GenerationSettings

ENSEMBLE_MODES = ("mean", "product")
ENSEMBLE, AMATEUR = "ensemble", "amateur"
DEFAULT_CD_BETA = 0.5  # O'Brien and Lewis 2023
DEFAULT_CD_ALPHA = 0.1  # Li et al. 2023


@dataclass(frozen=True)
class Partner:
    """A model combined with the main one: an ensemble member with its `weight`
    (relative to the main model's 1), or the amateur of contrastive decoding."""

    lm: LoadedModel
    role: str  # ENSEMBLE or AMATEUR
    weight: float = 1.0


@dataclass(frozen=True)
class Combination:
    """How one generation combines `models` (the main model first): `kind` is `mean`,
    `product` or `contrastive`; `weights` (ensembles) sum to 1."""

    kind: str
    models: tuple[LoadedModel, ...]
    weights: tuple[float, ...] = ()
    beta: float = DEFAULT_CD_BETA
    alpha: float = DEFAULT_CD_ALPHA

    def combine(self, logits: Sequence[torch.Tensor]) -> torch.Tensor:
        """The combined log-scores of the models' `logits` (each (..., vocab))."""
        logprobs = [x.float().log_softmax(-1) for x in logits]
        if self.kind == "mean":
            return mixture(logprobs, self.weights)
        if self.kind == "product":
            return product(logprobs, self.weights)
        return contrastive(logprobs[0], logprobs[1], self.beta, self.alpha)

    def describe(self) -> str:
        """The combination in a few words, for --stats and --json's backend reason."""
        if self.kind == "contrastive":
            return (f"contrastive decoding (beta {self.beta:g}, alpha {self.alpha:g}) "
                    f"against {self.models[1].ref}")
        members = ", ".join(f"{m.ref} {w:.3g}" for m, w in zip(self.models, self.weights))
        return f"{self.kind} ensemble of {members}"


def mixture(logprobs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """mean: log sum_i w_i p_i, from each model's log p_i (weights summing to 1). Summed
    as probabilities: a token every model gives p below float32's ~1e-38 gets -inf."""
    probs = [lp.exp() for lp in logprobs]
    if len(probs) == 2:  # one op: lerp(p_0, p_1, w_1) = w_0 p_0 + w_1 p_1 where w_0 + w_1 = 1
        return torch.lerp(probs[0], probs[1], weights[1]).log_()
    total = probs[0] * weights[0]
    for p, w in zip(probs[1:], weights[1:]):
        total.add_(p, alpha=w)
    return total.log_()


def product(logprobs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """product of experts: log_softmax(sum_i w_i log p_i)."""
    total = logprobs[0] * weights[0]
    for lp, w in zip(logprobs[1:], weights[1:]):
        total.add_(lp, alpha=w)
    return total.log_softmax(-1)


def contrastive(expert: torch.Tensor, amateur: torch.Tensor, beta: float, alpha: float
                ) -> torch.Tensor:
    """(1 + beta) log p_e - beta log p_a where p_e >= alpha * max p_e, else -inf."""
    # lerp(a, e, 1 + beta) = a + (1 + beta)(e - a): the score in one op (log p_a is finite,
    # the log_softmax of finite logits)
    scores = torch.lerp(amateur, expert, 1 + beta)
    return scores.masked_fill_(_implausible(expert, alpha), -math.inf)


def plausible(expert: torch.Tensor, alpha: float) -> torch.Tensor:
    """The plausibility head: p_e >= alpha * max p_e (a token the expert gives 0 never)."""
    return ~_implausible(expert, alpha)


def _implausible(expert: torch.Tensor, alpha: float) -> torch.Tensor:
    """p_e < alpha * max p_e, from log p_e (p_e = 0 always)."""
    if alpha == 0:
        return expert == -math.inf
    return expert < expert.amax(-1, keepdim=True).add_(math.log(alpha))


def normalised(weights: Sequence[float]) -> tuple[float, ...]:
    """Weights scaled to sum to 1."""
    total = sum(weights)
    return tuple(w / total for w in weights)


def combination_of(lm: LoadedModel, settings: GenerationSettings) -> Combination | None:
    """The combination `settings` ask for over `lm` and its partners; None for one model.
    ConfigError where the settings ask for a model the run did not load."""
    members = [p for p in lm.partners if p.role == ENSEMBLE]
    amateurs = [p for p in lm.partners if p.role == AMATEUR]
    if settings.ensemble_mode is not None:
        if not members:
            raise ConfigError(f"ensemble_mode {settings.ensemble_mode} combines models: give "
                              f"--ensemble MODEL[:WEIGHT] (or drop ensemble_mode)")
        weights = normalised([1.0] + [p.weight for p in members])
        return Combination(settings.ensemble_mode, (lm, *(p.lm for p in members)), weights)
    if settings.cd_beta is not None:
        if not amateurs:
            raise ConfigError("cd_beta is contrastive decoding's weight on an amateur "
                              "model: give --amateur MODEL (or drop cd_beta)")
        return Combination("contrastive", (lm, amateurs[0].lm), beta=settings.cd_beta,
                           alpha=settings.cd_alpha)
    return None


def parse_member(text: str) -> tuple[str, float]:
    """`MODEL[:WEIGHT]` as (model, weight); a suffix that is not a number belongs to the
    model's name (`builtin:code-small`). ConfigError for a weight that is not > 0."""
    ref, sep, tail = text.rpartition(":")
    try:
        weight = float(tail) if sep else None
    except ValueError:
        weight = None
    if weight is None:
        ref, weight = text, 1.0
    if not ref.strip():
        raise ConfigError(f"--ensemble {text!r} names no model; give MODEL or MODEL:WEIGHT")
    if not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"--ensemble {text}: the weight must be a number > 0, got "
                          f"{tail}")
    return ref, weight


def check_partner(lm: LoadedModel, other: LoadedModel, flag: str) -> None:
    """ConfigError unless `other` can be combined with `lm` token by token: the same
    device, the same vocabulary id by id, the same special tokens."""
    if other.device != lm.device:
        raise ConfigError(f"{flag} {other.ref} is on {other.device} and {lm.ref} on "
                          f"{lm.device}; combined models run on one device: give --device")
    difference = tokenizer_difference(lm.tokenizer, other.tokenizer)
    if difference is None and other.vocab_size != lm.vocab_size:
        difference = (f"its model has {other.vocab_size} logits per token, "
                      f"{lm.ref}'s {lm.vocab_size}")
    if difference is not None:
        raise ConfigError(f"{flag} {other.ref}: its tokenizer differs from {lm.ref}'s "
                          f"({difference}); combined models need one tokenizer")


def tokenizer_difference(a: Any, b: Any) -> str | None:
    """Where two tokenizers differ, in words (the first token id whose token differs,
    else the first special token that differs); None when they are the same."""
    pieces_a, pieces_b = _pieces(a), _pieces(b)
    for tid in range(max(len(pieces_a), len(pieces_b))):
        left = pieces_a[tid] if tid < len(pieces_a) else None
        right = pieces_b[tid] if tid < len(pieces_b) else None
        if left != right:
            return f"first at token id {tid}: {left!r} against {right!r}"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        left, right = getattr(a, name, None), getattr(b, name, None)
        if left != right:
            return f"{name} {left} against {right}"
    return None


def _pieces(tokenizer: Any) -> list[str | None]:
    """The tokenizer's token for every id, in id order (None for an id it lacks)."""
    vocab = tokenizer.get_vocab()
    pieces: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for piece, tid in vocab.items():
        pieces[tid] = piece
    return pieces
