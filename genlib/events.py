"""The typed events genlib's generators yield: one stream feeds every consumer
(`generate`, the REPL, `compare`, `speculate`, `bench`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Prefill:
    """The prompt(s) went through the model once; `seconds` is the prefill's wall time.
    `backend` names the backend that runs the generation and `backend_reason` why it was
    chosen (genlib.backends.choose); `draft_weights`, in speculative decoding with a draft
    model, how its backend stores the draft's matrices (a torch dtype name);
    `weight_bytes`, the bytes of weights that backend holds, in the format it runs
    (`Backend.weight_bytes`)."""

    prompt_tokens: tuple[int, ...]  # per row
    seconds: float
    time: float  # perf_counter() at the end of prefill
    backend: str = ""
    backend_reason: str = ""
    draft_weights: str | None = None
    weight_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Token:
    """One new token of one row.

    `text` is the printable text this token completed (may be empty while a multi-byte
    character or a possible stop string is pending); joined, the texts of a row equal
    its final text. `logprob` is the token's log-probability under the model before any
    processor. `draft` is None outside speculative decoding, else whether the draft
    proposed this token (True) or the target produced it (False). `detail` is the
    step's record (`genlib.decoding.detail.StepDetail`: processed logprob, alternatives, the
    chain's stages) when the caller asked for one, else None.
    """

    row: int
    token_id: int
    text: str
    logprob: float
    index: int
    time: float
    draft: bool | None = None
    detail: Any = None


@dataclass(frozen=True, slots=True)
class Finish:
    """A row is done. `reason`: eos, length, stop, time or interrupted.

    `tail` is text that was still pending when the row ended (held back as a possible
    stop string, or an incomplete character): print it after the streamed pieces.
    `text` is the whole output text, the stop string excluded.
    """

    row: int
    prompt_index: int
    reason: str
    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    start: float
    first_token: float | None
    end: float
    logprobs: tuple[float, ...] = field(default=())
    tail: str = ""
    score: float | None = None  # beam search: the hypothesis' length-normalised score

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds (from the start of prefill)."""
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tokens_per_second(self) -> float | None:
        """Decode speed after the first token (the first one pays for prefill): the
        tokens after it over the time since it. None with fewer than two tokens, where
        there is no decode interval to measure."""
        if self.first_token is None or self.new_tokens < 2 or self.end <= self.first_token:
            return None
        return (self.new_tokens - 1) / (self.end - self.first_token)


@dataclass(frozen=True, slots=True)
class Verify:
    """One speculative step (genlib.decoding.speculative): the drafter proposed `proposed` tokens
    and the target's single forward kept the first `accepted` of them; the step's Token
    events follow. `draft_forwards` counts the draft model's forward passes (0 for prompt
    lookup); the seconds are wall time spent drafting and verifying."""

    row: int
    proposed: int
    accepted: int
    draft_seconds: float
    target_seconds: float
    draft_forwards: int
    time: float


@dataclass(frozen=True, slots=True)
class BeamStep:
    """One step of beam search for one prompt: the running best hypothesis (`best_ids`,
    its length-normalised `best_score`) and, when the tree is recorded, the step's
    candidates (`genlib.decoding.beam.TreeCandidate`s). The Token events of a beam row carry only
    its settled tokens (those every hypothesis that can still win shares), so they join
    to the final text; this event is the running view."""

    step: int
    prompt_index: int
    best_ids: tuple[int, ...]
    best_score: float
    candidates: tuple[Any, ...] = ()
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class Rerank:
    """Sample and rerank (`genlib.decoding.rerank`) chose one of a prompt's samples: `samples` are
    their Finish events (rows of the sampling batch), `scores` each one's score under
    `method` (logprob, mbr, or the scoring model's name; higher is better, None for an
    empty sample), `chosen` the index of the kept one in `samples`. The chosen sample's
    Token events and a Finish as the prompt's output row follow."""

    prompt_index: int
    method: str
    samples: tuple[Finish, ...]
    scores: tuple[float | None, ...]
    chosen: int
    seconds: float  # scoring time
    time: float


Event = Prefill | Token | Finish | Verify | BeamStep | Rerank
