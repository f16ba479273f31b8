"""Stopping: end ids, token budget, stop strings on the decoded text, wall time."""

from __future__ import annotations

from collections.abc import Iterable


class StopStrings:
    """Finds stop strings in a growing text, even when one spans several tokens, and
    holds back any tail that could still become a stop string, so it is never printed."""

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add decoded text; return the part that is safe to print now."""
        if self.stopped:
            return ""
        if not self.stops:
            self.text += piece
            self.emitted = len(self.text)
            return piece
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            self.stopped = True
            return self._emit_to(cut)
        return self._emit_to(len(self.text) - self._held_back())

    def finish(self) -> str:
        """The rest of the text, at the end of generation."""
        return "" if self.stopped else self._emit_to(len(self.text))

    @property
    def final_text(self) -> str:
        return self.text[:self.emitted] if self.stopped else self.text

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop."""
        for size in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0

    def _emit_to(self, end: int) -> str:
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
