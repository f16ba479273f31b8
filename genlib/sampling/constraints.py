"""Constraints for constrained beam search: phrases that must appear in the output, and
disjunctive sets (any one of several phrases).

The search keeps, per beam, how far each constraint has progressed; at each step it adds
to the usual top candidates the tokens that would advance a constraint, and allocates
the beams over "banks" (number of constraint tokens met), best bank first, round robin
(Hokamp & Liu, 2017, "Lexically Constrained Decoding ... Grid Beam Search"; Post & Vilar,
2018, "Fast Lexically Constrained Decoding with Dynamic Beam Allocation"; as described in
Hugging Face's "Guiding Text Generation with Constrained Beam Search" blog).

A constraint state is a tuple with one entry per constraint: None once the constraint is
met, else the progress (matched prefix length) of each of its phrases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from genlib.errors import ConfigError

State = tuple[tuple[int, ...] | None, ...]


@dataclass(frozen=True)
class Constraint:
    """One requirement: any one of `phrases` (token id sequences) must appear."""

    label: str
    phrases: tuple[tuple[int, ...], ...]

    @property
    def min_tokens(self) -> int:
        return min(len(p) for p in self.phrases)

    @property
    def max_tokens(self) -> int:
        return max(len(p) for p in self.phrases)


def build_constraints(tokenizer: Any, force_words: Sequence[str], force_any: Sequence[str],
                      max_new_tokens: int, stop_strings: Sequence[str] = ()
                      ) -> tuple[Constraint, ...]:
    """Tokenize forced phrases (`force_words`) and sets "A|B|C" (`force_any`).

    Raises ConfigError when a phrase has no tokens, when it holds one of `stop_strings`
    (the output would end at it, and its text is cut there), or when the shortest way to
    meet every constraint needs more than `max_new_tokens` tokens: such a search could
    never succeed.
    """
    for phrase in force_words:
        _check_stops(phrase, stop_strings)
    constraints = [Constraint(w, _spellings(tokenizer, w)) for w in force_words]
    for spec in force_any:
        options = [o.strip() for o in spec.split("|") if o.strip()]
        if not options:
            raise ConfigError(f"force_any {spec!r} has no phrase; write it as 'A|B|C'")
        for option in options:
            _check_stops(option, stop_strings)
        spellings = tuple(dict.fromkeys(s for o in options for s in _spellings(tokenizer, o)))
        constraints.append(Constraint(spec, spellings))
    needed = sum(c.min_tokens for c in constraints)
    if needed > max_new_tokens:
        raise ConfigError(f"the forced phrases need at least {needed} tokens but max_new_tokens "
                          f"is {max_new_tokens}; raise --max-new-tokens or force fewer phrases")
    return tuple(constraints)


def _check_stops(phrase: str, stop_strings: Sequence[str]) -> None:
    """A forced phrase holding a stop string could never be shown: the output would end
    there, cut before the stop string."""
    for stop in stop_strings:
        if stop in phrase:
            raise ConfigError(f"forced phrase {phrase!r} contains the stop string {stop!r}, so "
                              f"an output would end before showing it; drop one of them")


def _spellings(tokenizer: Any, phrase: str) -> tuple[tuple[int, ...], ...]:
    """The token sequences a phrase can appear as: on its own, and mid-text after a space.

    Byte-level BPE tokenizers spell " return" (one token, "Ġreturn") differently from
    "return"; sentencepiece ones usually agree. Leading whitespace-only tokens of the
    mid-text spelling are dropped (the space belongs to the text before).
    """
    alone = _phrase_ids(tokenizer, phrase)
    spaced = list(_phrase_ids(tokenizer, " " + phrase))
    while len(spaced) > 1 and not tokenizer.decode(spaced[:1]).strip():
        spaced.pop(0)
    return tuple(dict.fromkeys((alone, tuple(spaced))))


def _phrase_ids(tokenizer: Any, phrase: str) -> tuple[int, ...]:
    ids = tuple(int(i) for i in tokenizer(phrase, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ConfigError(f"forced phrase {phrase!r} encodes to no tokens")
    return ids


def initial_state(constraints: Sequence[Constraint]) -> State:
    return tuple(tuple(0 for _ in c.phrases) for c in constraints)


def _progress(phrase: tuple[int, ...], matched: int, token: int) -> int:
    """Longest prefix of `phrase` that ends the text `phrase[:matched] + token`."""
    seen = phrase[:matched] + (token,)
    for size in range(min(len(seen), len(phrase)), 0, -1):
        if seen[len(seen) - size:] == phrase[:size]:
            return size
    return 0


def advance(constraints: Sequence[Constraint], state: State, token: int) -> State:
    """The state after generating `token`."""
    out: list[tuple[int, ...] | None] = []
    for c, progress in zip(constraints, state):
        if progress is None:
            out.append(None)
            continue
        new = tuple(_progress(p, m, token) for p, m in zip(c.phrases, progress))
        out.append(None if any(m == len(p) for p, m in zip(c.phrases, new)) else new)
    return tuple(out)


def advancing_tokens(constraints: Sequence[Constraint], state: State) -> set[int]:
    """Tokens that would extend the progress of some constraint not met yet."""
    return {p[m] for c, progress in zip(constraints, state) if progress is not None
            for p, m in zip(c.phrases, progress)}


def bank(constraints: Sequence[Constraint], state: State) -> int:
    """Constraint tokens met so far: a met constraint counts its longest phrase."""
    return sum(c.max_tokens if progress is None else max(progress)
               for c, progress in zip(constraints, state))


def satisfied(state: State) -> bool:
    return all(progress is None for progress in state)


def round_robin(banks: Sequence[int], scores: Sequence[float]) -> list[int]:
    """Dynamic beam allocation (Post & Vilar, 2018): candidate indices ordered so that the
    best of each bank comes first (highest bank first), then the second best of each, ...
    The first k of this order become the beams, so no bank takes over the beam."""
    by_bank = sorted(range(len(banks)), key=lambda i: (-banks[i], -scores[i]))
    rank_in_bank: list[int] = []
    for pos, i in enumerate(by_bank):
        same = pos > 0 and banks[by_bank[pos - 1]] == banks[i]
        rank_in_bank.append(rank_in_bank[-1] + 1 if same else 0)
    order = sorted(range(len(by_bank)), key=lambda pos: rank_in_bank[pos])
    return [by_bank[pos] for pos in order]
