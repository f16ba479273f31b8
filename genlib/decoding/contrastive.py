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

    events = stream(lm, [lm.encode("Once upon a time")], settings, backend)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from genlib.backends.base import Backend
from genlib.decoding.step import (
    Plan,
    Row,
    advance,
    check_prompts,
    context_of,
    finish_row,
    make_plan,
    new_row,
    process_logits,
    stop_reason,
)
from genlib.errors import ConfigError
from genlib.events import Event, Prefill
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


def stream(lm: LoadedModel, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
           backend: Backend, *, seeds: Sequence[int] | None = None) -> Iterator[Event]:
    """Contrastive search for one prompt on a backend that gives hidden states (the
    lean one); yield events as the plain decode loop does."""
    check_prompts(lm, prompts, settings)
    if settings.top_k > lm.vocab_size:
        raise ConfigError(f"top_k {settings.top_k} is more candidates than the model's "
                          f"{lm.vocab_size} tokens")
    plan = make_plan(lm, settings, 1, seeds, len(prompts[0]))
    yield from _search(lm, backend, plan, new_row(lm, 0, prompts[0], settings))


def _search(lm: LoadedModel, backend: Backend, plan: Plan, row: Row) -> Iterator[Event]:
    settings = plan.settings
    start = time.perf_counter()
    deadline = start + settings.max_time if settings.max_time else None
    prompt = row.prompt_ids
    try:
        logits, states = backend.prefill_states(prompt, len(prompt) + settings.max_new_tokens,
                                                (_final_layer(backend),), spare=settings.top_k)
        hidden = states[0]
        context = context_of([prompt], lm.device) if plan.needs_context else None
        yield Prefill((len(prompt),), time.perf_counter() - start, time.perf_counter(),
                      backend.name, backend.reason)
        for step in range(settings.max_new_tokens):
            processed = process_logits(settings, plan.chain, plan.suppress_eos, context,
                                       logits, step)
            token, next_logits, next_hidden = _choose(backend, settings, processed, hidden)
            tokens = torch.tensor([token], device=processed.device)
            processors.observe(plan.chain, processed, tokens)
            logprob = float(logits.log_softmax(dim=-1)[0, token])
            now = time.perf_counter()
            event, reason = advance(lm, row, 0, token, logprob, step, now)
            if event is not None:
                yield event
            reason = stop_reason(plan, row, reason, step, now, deadline)
            if reason is not None:
                yield from finish_row(row, 0, reason, start)
                return
            logits, hidden = next_logits, torch.cat([hidden, next_hidden])
            if context is not None:
                context = torch.cat([context, tokens[:, None].to(context.device)], dim=1)
    except KeyboardInterrupt:
        if not row.finished:
            yield from finish_row(row, 0, "interrupted", start)


def _final_layer(backend: Backend) -> int:
    """The number of the last hidden state (after the final norm) on `backend`."""
    lean = getattr(backend, "lean", None)
    if lean is None:
        raise backend.refuse("gives no hidden states (contrastive search needs them)", "lean")
    return int(lean.num_layers)


def _choose(backend: Backend, settings: GenerationSettings, processed: torch.Tensor,
            hidden: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One step: the top_k candidates of the processed distribution run one step each,
    ranked (`rank`), the best kept; (its token, its logits (1, vocab), its final hidden
    state (1, hidden))."""
    probs, ids = processed.softmax(dim=-1)[0].topk(settings.top_k)
    logits, states = backend.candidates(ids)
    assert settings.penalty_alpha is not None  # routed here only then
    index = rank(probs, hidden, states, settings.penalty_alpha)
    backend.keep_candidate(index)
    return int(ids[index]), logits[index:index + 1], states[index:index + 1]
