"""Contrastive search (Su et al., 2022, "A Contrastive Framework for Neural Text
Generation"), as transformers' implementation (`transformers-community/contrastive-search`,
formerly `generate(penalty_alpha=..., top_k=...)`) defines it, on the lean forward.

At each step the top_k tokens v of the model's (processed) distribution p are the
candidates; each is run one step to get its last hidden state h_v (after the final
norm, transformers' `hidden_states[-1]`), and the one with the highest

    (1 - alpha) * p(v) - alpha * max_j cos(h_v, h_j)

over the context's hidden states h_j (prompt and generated tokens) is taken: the
model's confidence against the degeneration penalty. The k candidates run as one
forward of k rows at the same position; the chosen one's logits are the next step's,
so a token costs one forward of k rows (`Backend.candidates`).

    events = search(lm, [lm.encode("Once upon a time")], settings, backend)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from genlib.backends.base import Backend
from genlib.decoding import loop
from genlib.decoding.step import Plan, check_prompts, make_plan, new_row, process_logits
from genlib.errors import ConfigError
from genlib.events import Event
from genlib.models.loading import LoadedModel
from genlib.sampling import processors
from genlib.settings.config import GenerationSettings


def degeneration_penalty(context: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """max_j cos(h_v, h_j) for each candidate h_v (k, hidden) over the context's h_j
    (length, hidden): (k,)."""
    unit_context = context / context.norm(dim=-1, keepdim=True)
    unit_candidates = candidates / candidates.norm(dim=-1, keepdim=True)
    return (unit_candidates @ unit_context.T).max(dim=-1).values


def rank(probs: torch.Tensor, context: torch.Tensor, candidates: torch.Tensor,
         alpha: float) -> int:
    """The candidate with the highest (1 - alpha) * p(v) - alpha * degeneration penalty
    (`probs` (k,): the candidates' probabilities); the first of equal scores."""
    score = (1.0 - alpha) * probs - alpha * degeneration_penalty(context, candidates)
    return int(score.argmax())


def search(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
           backend: Backend, *, seeds: Sequence[int] | None = None) -> Iterator[Event]:
    """Contrastive search for one prompt on a backend that gives hidden states (the
    lean one): the plain decode loop (`loop.run`) with `Candidates` as its step."""
    check_prompts(lm, prompts, settings)
    if settings.top_k > lm.vocab_size:
        raise ConfigError(f"top_k {settings.top_k} is more candidates than the model's "
                          f"{lm.vocab_size} tokens")
    plan = make_plan(lm, settings, 1, seeds, len(prompts[0]))
    row = new_row(lm, 0, prompts[0], settings)
    yield from loop.run(lm, backend, plan, [row], Candidates())


class Candidates:
    """Contrastive search's step (a `loop.Stepper`): the top_k candidates run one step
    each, the best by `rank` is kept, and its logits are the next step's, so the loop's
    own forward has nothing left to run. Holds the context's final hidden states."""

    draft_weights = None

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None  # (length, hidden)
        self.next: tuple[torch.Tensor, torch.Tensor] | None = None  # kept logits, state

    def prefill(self, backend: Backend, plan: Plan, prompts: Sequence[Sequence[int]],
                capacity: int) -> torch.Tensor:
        [prompt] = prompts
        logits, states = backend.prefill_states(prompt, capacity, (_final_layer(backend),),
                                                spare=plan.settings.top_k)
        self.hidden = states[0]
        return logits

    def choose(self, backend: Backend, plan: Plan, context: torch.Tensor | None,
               logits: torch.Tensor | None, step: int) -> loop.Chosen:
        assert logits is not None
        settings = plan.settings
        processed = process_logits(settings, plan.chain, plan.suppress_eos, context, logits,
                                   step)
        assert self.hidden is not None and settings.penalty_alpha is not None
        probs, ids = processed.softmax(dim=-1)[0].topk(settings.top_k)
        candidate_logits, states = backend.candidates(ids)
        index = rank(probs, self.hidden, states, settings.penalty_alpha)
        backend.keep_candidate(index)
        self.next = candidate_logits[index:index + 1], states[index:index + 1]
        tokens = ids[index:index + 1]
        processors.observe(plan.chain, processed, tokens)
        logprobs = logits.log_softmax(dim=-1)[0, tokens]
        return loop.one_each(tokens, logprobs)

    def forward(self, backend: Backend, tokens: torch.Tensor) -> torch.Tensor:
        assert self.next is not None and self.hidden is not None
        logits, state = self.next
        self.hidden = torch.cat([self.hidden, state])
        return logits

    def interrupted(self) -> None:
        return None


def _final_layer(backend: Backend) -> int:
    """The number of the last hidden state (after the final norm) on `backend`."""
    lean = getattr(backend, "lean", None)
    if lean is None:
        raise backend.refuse("gives no hidden states (contrastive search needs them)", "lean")
    return int(lean.num_layers)
