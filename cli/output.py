"""The machine-readable output every command shares (docs/output.md,
docs/output.schema.json): `--json` writes one JSON document, `--jsonl` one object per
output as each is ready, `-o/--output FILE` writes what would go to stdout (the text,
or either JSON) to FILE instead.

The shared parts are built here only, so every command names the same thing alike:
`model`, `settings`, `prompt`, `prompt_tokens`, and per output `index` (from 1, as the
tables count), `text`, `token_ids`, `finish_reason`, `new_tokens` and `timings`.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from genlib.events import Finish
    from genlib.settings.config import GenerationSettings

SCHEMA_VERSION = 2
OUTPUT_PANEL = "Output"

Json = Annotated[bool, typer.Option(
    "--json", rich_help_panel=OUTPUT_PANEL,
    help="Print one JSON document (docs/output.md) instead of the text.")]
Jsonl = Annotated[bool, typer.Option(
    "--jsonl", rich_help_panel=OUTPUT_PANEL,
    help="Print one JSON object per output, each as soon as it is ready (for pipes).")]
OutputFile = Annotated[str | None, typer.Option(
    "--output", "-o", rich_help_panel=OUTPUT_PANEL, metavar="FILE",
    help="Write what would go to stdout (the text, or the JSON) to FILE instead; stderr "
         "is unchanged.")]


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("genlab")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


# --- the shared pieces ------------------------------------------------------------------

def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def timings(*, total_s: float, prefill_s: float | None = None, ttft_s: float | None = None,
            tokens_per_s: float | None = None) -> dict[str, float | None]:
    """Seconds spent, the same four keys everywhere (None where a command cannot know)."""
    return {"prefill_s": _round(prefill_s), "ttft_s": _round(ttft_s),
            "total_s": _round(total_s), "tokens_per_s": _round(tokens_per_s, 3)}


def output(index: int, text: str, token_ids: Any, finish_reason: str,
           timing: dict[str, float | None], **extra: Any) -> dict[str, Any]:
    """One output: `index` counts from 1; `extra` holds a command's own facts."""
    ids = [int(i) for i in token_ids]
    return {"index": index, "text": text, "token_ids": ids, "finish_reason": finish_reason,
            "new_tokens": len(ids), "timings": timing, **extra}


def finish_output(finish: Finish, index: int, prefill_s: float | None = None,
                  **extra: Any) -> dict[str, Any]:
    """An output from a decode loop's Finish event."""
    if finish.score is not None:
        extra = {"score": finish.score, **extra}
    return output(index, finish.text, finish.token_ids, finish.reason,
                  timings(total_s=finish.end - finish.start, prefill_s=prefill_s,
                          ttft_s=finish.ttft, tokens_per_s=finish.tokens_per_second),
                  **extra)


def document(command: str, model: str | None, **fields: Any) -> dict[str, Any]:
    """A command's whole JSON document: what ran, then the command's fields."""
    return {"schema_version": SCHEMA_VERSION, "genlab_version": version(),
            "command": command, "model": model, **fields}


def run_document(command: str, model: str, settings: GenerationSettings, prompt: str,
                 prompt_tokens: int, outputs: list[dict[str, Any]], **fields: Any
                 ) -> dict[str, Any]:
    """The document of a command that runs one prompt through one set of settings."""
    return document(command, model, settings=settings.to_dict(), prompt=prompt,
                    prompt_tokens=prompt_tokens, outputs=outputs, **fields)


def line(doc: dict[str, Any], out: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A --jsonl line: an output with the run facts of its document beside it."""
    shared = {key: doc[key] for key in ("schema_version", "genlab_version", "command", "model",
                                        "backend", "model_files", "prompt", "prompt_tokens")
              if key in doc}
    if "settings" in doc:
        shared["settings"] = doc["settings"]
    return shared | fields | out


# --- where it goes ----------------------------------------------------------------------

@dataclass
class Sink:
    """Where a command's stdout output goes and in which form: "text", "json" (one
    document at the end) or "jsonl" (one line per output as it is ready)."""

    mode: str = "text"
    path: str | None = None
    _handle: IO[str] | None = None
    # With --chat, the messages the chat template made the prompt of: each document and
    # line with a `prompt` carries them beside it, as `messages` (`with_messages`).
    messages: list[dict[str, str]] | None = None

    @property
    def machine(self) -> bool:
        """JSON of either kind: the human view stays off stdout."""
        return self.mode != "text"

    @property
    def to_stdout(self) -> bool:
        return self.path is None or self.path == "-"

    def stream(self) -> IO[str]:
        if self.to_stdout:
            return sys.stdout
        if self._handle is None:
            try:
                self._handle = Path(self.path or "").open("w", encoding="utf-8")
            except OSError as exc:
                from cli.errors import fail

                raise fail(f"cannot write {self.path}: {exc.strerror}; pick a writable "
                           f"path") from None
        return self._handle

    def write(self, text: str) -> None:
        handle = self.stream()
        handle.write(text)
        handle.flush()

    def json_document(self, doc: dict[str, Any]) -> None:
        if self.mode == "json":
            self.write(json.dumps(self.with_messages(doc), ensure_ascii=self._ascii(),
                                  indent=2) + "\n")

    def json_line(self, obj: dict[str, Any]) -> None:
        if self.mode == "jsonl":
            self.write(json.dumps(self.with_messages(obj), ensure_ascii=self._ascii()) + "\n")

    def with_messages(self, doc: dict[str, Any]) -> dict[str, Any]:
        """`doc` with `messages` after its `prompt` where --chat made the prompt."""
        if self.messages is None or "prompt" not in doc:
            return doc
        keys = list(doc)
        at = keys.index("prompt") + 1
        return {key: doc[key] for key in keys[:at]} | {"messages": self.messages} | \
            {key: doc[key] for key in keys[at:]}

    def _ascii(self) -> bool:
        """\\u escapes (the same JSON) where stdout's encoding could not hold every
        character (PYTHONIOENCODING=ascii, a latin-1 locale); readable UTF-8 otherwise."""
        if not self.to_stdout:
            return False
        encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
        return encoding != "utf8"

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def sink(as_json: bool, as_jsonl: bool, path: str | None) -> Sink:
    """The Sink for a command's --json, --jsonl and -o flags; refuses both JSON forms,
    and an -o FILE that cannot be written, before any work."""
    if as_json and as_jsonl:
        from cli.errors import fail

        raise fail("--json and --jsonl exclude each other: --json writes one document, "
                   "--jsonl one line per output; pick one")
    if path is not None and path != "-":
        from cli.paths import check_output_path

        check_output_path(Path(path), "-o/--output")
    return Sink("json" if as_json else "jsonl" if as_jsonl else "text", path)


class _FileAsStdout(io.TextIOBase):
    """stdout while -o FILE is in force: writes go to the sink's file, opened at the
    first write, so that a run which fails before writing anything leaves no file."""

    encoding = "utf-8"

    def __init__(self, target: Sink) -> None:
        self._target = target

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._target.write(text)
        return len(text)


@contextmanager
def opened(target: Sink) -> Iterator[Sink]:
    """While the command runs, -o FILE is its stdout: FILE gets what stdout would have
    got (the text and tables as a pipe gets them, or the JSON), and nothing of it goes
    to the terminal. The file is closed at the end, whatever happens."""
    from cli import render

    try:
        if target.to_stdout:
            yield target
        else:
            with redirect_stdout(_FileAsStdout(target)), render.uncoloured():
                yield target
    finally:
        target.close()
