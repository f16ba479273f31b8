"""--stats for sample and rerank (`generate --samples N --rerank ...`): every sample's
score on stderr, the kept one marked, beside what made it (tokens, finish reason)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from cli.render import err

if TYPE_CHECKING:
    from genlib.events import Rerank

COLUMNS = ("kept", "sample", "score", "tokens", "finish", "text")


def scores(event: Rerank) -> None:
    """One row per sample: its number, score, tokens, finish reason and start of text;
    only the text is cut short where the terminal is narrow."""
    rows = [("→" if i == event.chosen else " ", str(i + 1),
             "-" if score is None else f"{score:.4f}", str(sample.new_tokens), sample.reason,
             " ".join(sample.text.split()))
            for i, (sample, score) in enumerate(zip(event.samples, event.scores))]
    widths = [max(len(name), *(len(row[n]) for row in rows)) for n, name in enumerate(COLUMNS)]
    room = max(12, err.width - sum(widths[:-1]) - 2 * (len(COLUMNS) - 1))
    table = Table(title=f"rerank: {event.method} (higher is better)", title_justify="left",
                  box=None, pad_edge=False)
    for name, width in zip(COLUMNS, widths):
        table.add_column(name, justify="right" if name in ("sample", "score", "tokens")
                         else "left", no_wrap=True, overflow="ellipsis",
                         width=min(width, room) if name == "text" else width)
    for i, row in enumerate(rows):
        table.add_row(*row, style="bold" if i == event.chosen else "dim")
    err.print(table)
