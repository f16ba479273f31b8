"""DoLa, Decoding by Contrasting Layers (Chuang et al., 2024, "DoLa: Decoding by
Contrasting Layers Improves Factuality in Large Language Models"), as transformers'
implementation (`transformers-community/dola`, formerly `generate(dola_layers=...)`)
defines it, on the lean forward's hidden states.

At each step the final layer's next-token distribution q_N is contrasted with that of a
premature layer M, chosen among the candidate layers as the one whose early-exit
distribution q_j (lm_head applied to layer j's hidden state, without the final norm, as
the reference code does) is furthest from q_N in Jensen-Shannon divergence. Tokens
below `RELATIVE_TOP` times q_N's top probability are dropped (the adaptive plausibility
constraint), and the rest scored log q_N - log q_M. The processors (repetition penalty:
the paper suggests 1.2) and the sampler then run on those scores as on any logits.

    layers = candidate_layers("high", lean.num_layers, lean.tied)
    backend = LayerContrast(choose_backend(lm, request), lean, layers)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from genlib.backends.base import Backend, Capabilities
from genlib.backends.choose import Request, choose_backend
from genlib.errors import ConfigError
from genlib.settings.config import GenerationSettings, layer_numbers

if TYPE_CHECKING:
    from genlib.backends.llama import LeanLlama
    from genlib.models.info import LoadedModel

RELATIVE_TOP = 0.1  # the plausibility constraint's alpha: keep p >= 0.1 * p_max
BASE_FILTERED = -1e-3  # the premature layer's score of a dropped token (transformers')
MANY_LAYERS = 40  # above this, low and high take 20 layers' worth (transformers')


def candidate_layers(dola_layers: str, num_layers: int, tied: bool) -> tuple[int, ...]:
    """The premature layers DoLa chooses from, numbered as `output_hidden_states` (0:
    the embeddings), as transformers' buckets define them: `low` every second layer from
    the start to the middle, `high` every second from the middle to the end (the first
    and last 20 past 40 layers). With tied embeddings the start skips the embeddings,
    whose early exit would be the identity. Layer numbers are taken as given; one at or
    past `num_layers` is refused (the final layer is the mature one)."""
    chosen = layer_numbers(dola_layers)
    if not isinstance(chosen, str):
        late = [j for j in chosen if j >= num_layers]
        if late:
            raise ConfigError(f"dola_layers {late[0]} is past the model's premature layers: "
                              f"it has {num_layers} layers, so 0..{num_layers - 1} (0: the "
                              f"embeddings), or low or high")
        return tuple(chosen)
    start = 0 if not tied else 2 if num_layers > 2 else 1 if num_layers == 2 else 0
    half = num_layers // 2
    if chosen == "high":
        first = half if num_layers <= MANY_LAYERS else num_layers - 20
        return tuple(range(first, num_layers, 2))
    if start == half:
        return (start,)
    return tuple(range(start, half if num_layers <= MANY_LAYERS else 20, 2))


def premature_layer(final: torch.Tensor, early: torch.Tensor) -> int:
    """The index, in `early` (layers, rows, vocab), of the layer whose distribution is
    furthest from `final`'s (rows, vocab) in Jensen-Shannon divergence, averaged over
    the rows: JSD = (KL(q_N || m) + KL(q_j || m)) / 2, m = (q_N + q_j) / 2 (each KL
    averaged over the vocabulary, as transformers' `F.kl_div(...).mean(-1)`)."""
    mixture = 0.5 * (final.softmax(-1)[None] + early.softmax(-1))
    kl_final = F.kl_div(final.log_softmax(-1)[None], mixture, reduction="none").mean(-1)
    kl_early = F.kl_div(early.log_softmax(-1), mixture, reduction="none").mean(-1)
    return int((0.5 * (kl_final + kl_early)).mean(-1).argmax())


def contrast(final: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """DoLa's scores: log q_N - log q_M where p_N >= RELATIVE_TOP * max p_N, -inf
    elsewhere (`_relative_top_filter`, min_tokens_to_keep 1)."""
    final_logp, base_logp = final.log_softmax(-1), base.log_softmax(-1)
    threshold = final_logp.max(-1, keepdim=True).values + math.log(RELATIVE_TOP)
    dropped = final_logp < threshold
    return (final_logp.masked_fill(dropped, float("-inf"))
            - base_logp.masked_fill(dropped, BASE_FILTERED))


def dola_logits(final: torch.Tensor, early: torch.Tensor) -> torch.Tensor:
    """One step of DoLa: `final` (rows, vocab) against the early-exit logits `early`
    (layers, rows, vocab), the premature layer chosen by `premature_layer` (the one
    layer when there is one)."""
    index = premature_layer(final, early) if early.shape[0] > 1 else 0
    return contrast(final, early[index])


class LayerContrast(Backend):
    """A hidden-state backend (the lean one) whose logits are DoLa's scores: the decode
    loop runs on it unchanged. One row."""

    capabilities = Capabilities(rows=1, reorder=False, extend=False, crop=False)

    def __init__(self, inner: Backend, lean: LeanLlama, layers: Sequence[int]) -> None:
        super().__init__(inner.lm)
        self.inner, self.lean, self.layers = inner, lean, tuple(layers)
        self.reason = inner.reason

    @property  # type: ignore[misc]
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def weight_bytes(self) -> int | None:
        return self.inner.weight_bytes

    def _scores(self, logits: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        early = self.lean.early_exit_logits(states[:, -1:])  # (layers, 1, vocab)
        self.length = self.inner.length
        return dola_logits(logits, early)

    def _prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor:
        return self._scores(*self.inner.prefill_states(rows[0], capacity, self.layers))

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._scores(*self.inner.step_states(int(tokens[0]), self.layers))

    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._step(tokens[:, 0])[:, None]


def dola_backend(lm: LoadedModel, settings: GenerationSettings, request: Request
                 ) -> LayerContrast:
    """The backend that gives DoLa's scores for `settings.dola_layers`: the lean one
    (`choose_backend` refuses others, and models it cannot run, in one line) under a
    `LayerContrast` over the candidate layers (out-of-range ones refused)."""
    assert settings.dola_layers is not None  # routed here only then
    inner = choose_backend(lm, replace(request, hidden="DoLa"))
    lean = inner.lean  # type: ignore[attr-defined]
    layers = candidate_layers(settings.dola_layers, lean.num_layers, lean.tied)
    return LayerContrast(inner, lean, layers)
