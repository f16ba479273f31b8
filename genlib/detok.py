"""Incremental detokenization that never prints broken UTF-8 and keeps the leading
spaces of sentencepiece tokens.

Each step decodes a short window of ids twice (with and without the new token) and
emits the difference, once it no longer ends in an incomplete character (U+FFFD). The
window starts inside the prompt, so a first generated token like "▁there" keeps its
space. Joined, the emitted pieces equal `decode(prompt + output) - decode(prompt)`.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 4  # prompt tokens kept as left context for the first window


class IncrementalDecoder:
    """Turns one row's token ids into text pieces as they arrive."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int] | tuple[int, ...] = (),
                 shared_cache: dict[int, str] | None = None):
        self._tokenizer = tokenizer
        # Decodes of one-token windows (the steady state's "before" text), shared by the
        # rows of a batch: halves the tokenizer calls per token.
        self._single = shared_cache if shared_cache is not None else {}
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # end of the text already emitted

    def _decode(self, ids: list[int]) -> str:
        if len(ids) == 1:
            text = self._single.get(ids[0])
            if text is None:
                text = self._single[ids[0]] = self._tokenizer.decode(
                    ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            return text
        return self._tokenizer.decode(ids, skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add a token; return the new complete text (possibly "")."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        if not after.startswith(before):
            # Decoding is not prefix-stable here (rare normalisers): emit what is new
            # at the end and restart the window at the current token.
            common = len(before)
            self._prefix, self._read = len(self._ids) - 1, len(self._ids)
            return after[common:]
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """Text still pending at the end (an incomplete character is emitted as is)."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):] if after.startswith(before) else ""
