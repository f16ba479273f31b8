"""All terminal output. stdout carries generated text or JSON only; everything else
(progress, stats, warnings, errors) goes to stderr. Rich drops colour codes when the
stream is not a terminal or NO_COLOR is set."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

PROMPT_STYLE = "dim"
TEXT_STYLE = ""
DRAFT_STYLE = "green"
TARGET_STYLE = "bold"


def error(message: str) -> None:
    err.print(f"[bold red]error:[/] {_escape(message)}")


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {_escape(message)}")


def warn_unused(settings: Any) -> None:
    """Warn about sampling settings the strategy ignores (`settings.unused`), if any."""
    if settings.unused:
        verb = "applies" if len(settings.unused) == 1 else "apply"
        warn(f"{', '.join(settings.unused)} only {verb} when sampling; strategy is "
             f"{settings.strategy}")


def info(message: str) -> None:
    err.print(_escape(message), style="dim")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def stream_text(text: str, style: str = TEXT_STYLE) -> None:
    """Print a piece of generated text as it arrives (no wrapping, no markup)."""
    if not text:
        return
    if out.is_terminal:
        out.print(text, end="", style=style or None, markup=False, highlight=False)
        out.file.flush()
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def end_line() -> None:
    stream_text("\n")


def stats(new_tokens: int, ttft: float | None, tps: float, reason: str,
          note: str = "") -> None:
    ttft_text = f"{ttft * 1000:.0f} ms" if ttft is not None else "-"
    err.print(f"[dim]{new_tokens} tokens · first token {ttft_text} · {tps:.1f} tok/s · "
              f"finish: {reason}{note}[/]")
