"""Drafters for speculative decoding: who proposes the tokens the target then checks.

Every drafter has one shape: `start(prompt_ids, capacity)` once, then per step
`propose(ids, gamma, process, generator, bans) -> Draft` and `commit(ids)` once the
target has decided which tokens stay (`bans`: what `process` does, where all it does is
ban ids; a draft model then drafts greedily in one backend call where it can).

- `ModelDrafter`: a small model sharing the target's vocabulary proposes gamma tokens
  autoregressively from its own KV cache (Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language
  Model Decoding with Speculative Sampling").
- `PromptLookupDrafter`: no model; proposes what followed the latest earlier occurrence
  of the context's last n-gram (Saxena 2023, "Prompt Lookup Decoding"; transformers'
  `prompt_lookup_num_tokens`). Its proposals are deterministic, so its q is a point mass.
- `LookupFirstDrafter`: both: prompt lookup's free proposal where the context has a
  match, the draft model's where it has none. Each step's proposal comes from one of
  them, with its own q, so each verify is exact on its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from genlib.backends.base import Backend, Bans
from genlib.errors import ModelLoadError
from genlib.models.loading import LoadedModel
from genlib.sampling import draws as sampling

# (context ids, raw logits (vocab,), position in the draft) -> processed logits (vocab,)
Process = Callable[[Sequence[int], torch.Tensor, int], torch.Tensor]


@dataclass
class Draft:
    """Proposed tokens, and q: the drafter's processed distribution for each of them
    (gamma, vocab), or None when the proposal is deterministic (q = one-hot)."""

    tokens: list[int]
    q: torch.Tensor | None
    seconds: float
    forwards: int


class Drafter(Protocol):
    draft_weights: str | None  # how a draft model's matrices are stored; None: no model

    def start(self, prompt_ids: Sequence[int], capacity: int | None = None) -> None:
        """Begin a generation of at most `capacity` tokens (prompt included)."""

    def propose(self, ids: Sequence[int], gamma: int, process: Process,
                generator: torch.Generator | None, bans: Bans | None = None) -> Draft:
        """Up to `gamma` tokens after `ids`, position i's logits processed by `process`;
        `bans`, where given, says that `process` only bans ids (and which)."""

    def commit(self, ids: Sequence[int]) -> None: ...


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """ModelLoadError unless the draft's tokens are the target's, id for id: speculation
    compares p(x) and q(x) for the same id x, so both must mean the same token by it."""
    sizes = (target.vocab_size, draft.vocab_size)
    same_tokens = target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    if sizes[0] != sizes[1] or not same_tokens:
        detail = (f"{sizes[1]} vs {sizes[0]} output tokens" if sizes[0] != sizes[1]
                  else "same size, different tokens")
        raise ModelLoadError(
            f"draft model {draft.ref} does not share the vocabulary of target {target.ref} "
            f"({detail}); pick a draft trained with the target's tokenizer, or use "
            f"--prompt-lookup N, which needs no draft model")


class ModelDrafter:
    """Drafts with a small model. Its cache always holds a prefix of the committed ids
    (never all of them), so each proposal feeds at least one token."""

    def __init__(self, lm: LoadedModel, backend: Backend, sample: bool):
        self.lm = lm
        self.backend = backend
        self.sample = sample
        self.draft_weights: str | None = backend.weights
        self.started = False
        self.cached: list[int] = []

    def start(self, prompt_ids: Sequence[int], capacity: int | None = None) -> None:
        self.cached = prefill_all_but_last(self.backend, prompt_ids,
                                           capacity or self.lm.max_positions or len(prompt_ids))
        self.started = True

    def propose(self, ids: Sequence[int], gamma: int, process: Process,
                generator: torch.Generator | None, bans: Bans | None = None) -> Draft:
        """x_i ~ q_i (or argmax q_i when greedy) for i = 1..gamma, one forward each:
        greedy under `bans` alone, in one backend call where the backend runs whole
        drafts (`draft_greedy`: no Python between the steps)."""
        assert self.started, "start() first"
        begin = time.perf_counter()
        context = list(ids)
        feed = context[len(self.cached):]
        if (bans is not None and not self.sample and gamma > 0
                and self.backend.capabilities.greedy_draft):
            return self._whole(feed, gamma, bans, begin)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        forwards = 0
        for i in range(gamma):
            logits = self.backend.extend(_as_batch(feed, self.lm))[0, -1]
            forwards += 1
            self.cached.extend(feed)
            q_logits = process(context, logits, i)
            top, best = q_logits.max(dim=-1)  # one pass: the greedy token and the test
            if not float(top) > -math.inf:
                break  # nothing may follow (a grammar has ended), or NaN: the draft ends
            if self.sample:
                q = q_logits.softmax(dim=-1)
                token = sampling.draw(q, generator)
                qs.append(q)
            else:
                token = int(best)
            tokens.append(token)
            context.append(token)
            feed = [token]
        q_all = torch.stack(qs) if qs else None
        return Draft(tokens, q_all, time.perf_counter() - begin, forwards)

    def _whole(self, feed: list[int], gamma: int, bans: Bans, begin: float) -> Draft:
        """The greedy draft in one backend call, no Python between its steps: a draft
        step is cheap enough that the loop's per-step Python (a tensor, the processing,
        the argmax) is a large share of it. The proposals are the loop's."""
        tokens, forwards = self.backend.draft_greedy(feed, gamma, bans)
        self.cached.extend(feed + tokens[:forwards - 1])  # every draw fed but the last
        return Draft(tokens, None, time.perf_counter() - begin, forwards)

    def commit(self, ids: Sequence[int]) -> None:
        """Roll the cache back past the first token that was not kept."""
        assert self.started, "start() first"
        keep = _common_prefix(self.cached, ids, limit=len(ids) - 1)
        self.backend.crop(keep)
        del self.cached[keep:]


class PromptLookupDrafter:
    """Proposes the continuation of the latest earlier match of the context's last
    n-gram, trying n = max_ngram down to 1. Costs no forward pass."""

    def __init__(self, max_ngram: int):
        if max_ngram < 1:
            raise ValueError(f"prompt lookup n-gram size must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.draft_weights: str | None = None

    def start(self, prompt_ids: Sequence[int], capacity: int | None = None) -> None:
        return None  # nothing cached

    def propose(self, ids: Sequence[int], gamma: int, process: Process,
                generator: torch.Generator | None, bans: Bans | None = None) -> Draft:
        begin = time.perf_counter()
        tokens = lookup(ids, self.max_ngram, gamma) if gamma > 0 else []
        return Draft(tokens, None, time.perf_counter() - begin, 0)

    def commit(self, ids: Sequence[int]) -> None:
        return None


class LookupFirstDrafter:
    """Prompt lookup first, the draft model where lookup finds no match: code repeats
    its own names and lines, which lookup proposes at no cost, and the draft model
    proposes the rest. The model's cache catches up on lookup's accepted tokens at its
    next proposal, in one forward over them."""

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter):
        self.lookup = lookup
        self.model = model
        self.draft_weights: str | None = model.draft_weights

    def start(self, prompt_ids: Sequence[int], capacity: int | None = None) -> None:
        self.model.start(prompt_ids, capacity)

    def propose(self, ids: Sequence[int], gamma: int, process: Process,
                generator: torch.Generator | None, bans: Bans | None = None) -> Draft:
        draft = self.lookup.propose(ids, gamma, process, generator)
        return draft if draft.tokens else self.model.propose(ids, gamma, process, generator,
                                                             bans)

    def commit(self, ids: Sequence[int]) -> None:
        self.model.commit(ids)


def lookup(ids: Sequence[int], max_ngram: int, gamma: int) -> list[int]:
    """Up to `gamma` tokens that followed the latest earlier occurrence of the last n
    tokens of `ids` (longest n first); [] when nothing matches."""
    seq = list(ids)
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + gamma]
    return []


def prefill_all_but_last(backend: Backend, ids: Sequence[int], capacity: int) -> list[int]:
    """Prefill `backend` with ids[:-1], room for `capacity` tokens; return those ids. The
    last token is fed by the first step, which then yields the logits for the first new
    position (one code path for every step)."""
    head = list(ids[:-1])
    backend.prefill([head], capacity)
    return head


def _as_batch(tokens: Sequence[int], lm: LoadedModel) -> torch.Tensor:
    return torch.tensor([list(tokens)], dtype=torch.long, device=lm.device)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b):
        if n >= limit or x != y:
            break
        n += 1
    return n
