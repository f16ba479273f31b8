"""All terminal output. stdout carries generated text or JSON only; everything else
(progress, stats, warnings, errors) goes to stderr. Rich drops colour codes when the
stream is not a terminal or NO_COLOR is set."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

# emoji=False: Rich would turn ":smile:" in a prompt, a path or a flag value into an emoji.
out = Console(highlight=False, soft_wrap=True, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)

PROMPT_STYLE = "dim"
TEXT_STYLE = ""
DRAFT_STYLE = "green"
TARGET_STYLE = "bold"


def counted(count: int, noun: str) -> str:
    """`count` and `noun`, plural but for one: "1 line", "3 lines"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def error(message: str) -> None:
    err.print(f"[bold red]error:[/] {_escape(message)}")


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {_escape(message)}", soft_wrap=not err.is_terminal)


def warn_unused(settings: Any) -> None:
    """Warn about sampling settings the strategy ignores (`settings.unused`), if any."""
    if settings.unused:
        verb = "applies" if len(settings.unused) == 1 else "apply"
        warn(f"{', '.join(settings.unused)} only {verb} when sampling; strategy is "
             f"{settings.strategy}")


class building:  # noqa: N801 - used as a context manager, like open()
    """Yields notify(message): prints the message on stderr, and on a terminal keeps a
    spinner turning beside it until the block ends."""

    def __init__(self) -> None:
        self._status: Any = None

    def __enter__(self) -> Any:
        return self.notify

    def notify(self, message: str) -> None:
        if err.is_terminal:
            self._status = err.status(message)
            self._status.start()
        else:
            err.print(f"[dim]{message}[/]")

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()
            err.print(f"[dim]{self._status.status} done[/]")


class compiling:  # noqa: N801 - used as a context manager, like open()
    """Yields notify(message) for `genlib.sampling.grammar.compile_for`: a context that shows the
    message while a slow compile lasts, with a spinner on a terminal, as one line
    elsewhere. It writes to a copy of file descriptor 2 taken on entry, because the
    compile puts a file on descriptor 2 to catch xgrammar's log meanwhile."""

    def __enter__(self) -> Any:
        import os

        self._file: Any = None
        self._terminal = err.is_terminal  # asked now: the compile puts a file on 2
        try:
            self._file = os.fdopen(os.dup(2), "w", encoding="utf-8", errors="replace")
        except OSError:  # no descriptor 2 to copy: nothing is shown
            pass
        return self.notify

    @contextmanager
    def notify(self, message: str) -> Iterator[None]:
        if self._file is None:
            yield
            return
        console = Console(file=self._file, force_terminal=self._terminal,
                          no_color=err.no_color, highlight=False, soft_wrap=True, emoji=False)
        if not self._terminal:
            console.print(f"[dim]{_escape(message)}...[/]")
            yield
            return
        with console.status(f"{_escape(message)}..."):
            yield
        console.print(f"[dim]{_escape(message)} done[/]")

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()


def warn_incomplete(reasons: list[str], max_new_tokens: int) -> bool:
    """Warn when an output stopped before its grammar could end (finish reason
    grammar_incomplete), or ended failing its JSON schema (schema_invalid): that text is
    not valid. Whether any did."""
    count = reasons.count("grammar_incomplete")
    if count:
        which = "an output" if count == 1 else f"{count} outputs"
        warn(f"{which} ended before the grammar was complete (max_new_tokens "
             f"{max_new_tokens} or max_time): the text is NOT valid; raise --max-new-tokens")
    invalid = reasons.count("schema_invalid")
    if invalid:
        which = "an output" if invalid == 1 else f"{invalid} outputs"
        warn(f"{which} ended where the grammar allowed, but the text is NOT valid against "
             f"the JSON schema: xgrammar does not enforce every keyword (allOf, not, "
             f"multipleOf, ...); express the constraint with properties, enum or a regex "
             f"pattern")
    return bool(count or invalid)


def info(message: str) -> None:
    """A note on stderr: broken between words on a terminal, one line in a file or pipe."""
    err.print(_escape(message), style="dim", soft_wrap=not err.is_terminal)


# Characters a terminal acts on instead of showing (ESC starts colour, title and cursor
# sequences; bidi controls reorder the line), which a message may quote from input that
# is not the user's own (a JSONL line's grammar, say): shown as escapes, as repr() does.
_VISIBLE = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))
            if chr(code) not in "\n\t"} | {
    code: f"\\u{code:04x}" for code in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def _escape(text: str) -> str:
    """`text` as plain text for Rich: no markup, no control characters."""
    from rich.markup import escape

    return escape(text.translate(_VISIBLE))


@contextmanager
def uncoloured() -> Iterator[None]:
    """The stdout view without colour codes for a while (-o FILE is stdout then): Rich
    settles a console's colours when it is made, from the stream it had then."""
    saved = out._color_system
    out._color_system = None
    try:
        yield
    finally:
        out._color_system = saved


def stream_text(text: str, style: str = TEXT_STYLE) -> None:
    """Print a piece of generated text as it arrives (no wrapping, no markup)."""
    if not text:
        return
    if out.is_terminal:
        out.print(text, end="", style=style or None, markup=False, highlight=False)
    else:
        out.file.write(text)
    out.file.flush()


def end_line() -> None:
    stream_text("\n")


def stats(new_tokens: int, ttft: float | None, tps: float | None, reason: str,
          backend: str = "", architecture: str = "", files: str = "") -> None:
    """--stats on stderr: tokens, time to the first token, decode tokens/s ("-" with one
    token: there is no decode interval) and the finish reason; then the backend that ran
    and the model's architecture, and how its files store the weights (`files`), on a
    line of their own where one line would be wider than the terminal."""
    ttft_text = f"{ttft * 1000:.0f} ms" if ttft is not None else "-"
    tps_text = f"{tps:.1f} tok/s" if tps is not None else "- tok/s"
    parts = [f"{new_tokens} tokens", f"first token {ttft_text}", tps_text, f"finish: {reason}"]
    if backend:
        parts.append(f"backend {backend}")
    if architecture:
        parts.append(architecture)
    if files:
        parts.append(files)
    print_parts(err, parts, style="dim")


def fit_parts(parts: list[str], width: int, sep: str = " · ") -> list[str]:
    """`parts` joined by `sep` into lines no wider than `width`, breaking only between
    parts (a part wider than `width` gets a line of its own, for Rich to wrap at words)."""
    from rich.cells import cell_len

    lines: list[str] = []
    for part in parts:
        if lines and cell_len(lines[-1] + sep + part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(part)
    return lines


def print_parts(console: Console, parts: list[str], style: str = "") -> None:
    """`fit_parts` on `console`, each line wrapped at words if still too wide (the
    consoles soft-wrap, which a terminal would break mid-word)."""
    from rich.text import Text

    for line in fit_parts(parts, console.width):
        console.print(Text(line, style=style), soft_wrap=False)
