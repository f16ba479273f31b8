"""`genlab generate --input prompts.jsonl --output results.jsonl`: generate for every
line of a JSONL file in real batches, resumable, with a progress bar on stderr.

The work (parsing, grouping, seeds, resume, writing) is genlib.batch; this module only
wires it to the terminal: progress, summary, exit code.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.context import ModelFlags, load
from cli.errors import INTERRUPTED, fail

if TYPE_CHECKING:
    from rich.progress import Progress

    from genlib.batch import Job, ResultWriter


DEFAULT_BATCH_SIZE = 16


@dataclass
class Tally:
    """What the summary reports."""

    lines: int = 0
    done: int = 0
    failed: int = 0
    skipped: int = 0
    failed_before: int = 0
    tokens: int = 0
    interrupted: bool = False
    generating_s: float = 0.0  # model loading excluded, for tokens/s


def check_modes(prompt: str | None, interactive: bool, input_path: Path | None,
                output: str | None, batch_size: int | None,
                single_prompt_flags: dict[str, bool] | None = None) -> None:
    """The ways to run `genlab generate` exclude each other; say which flag to drop.

    `single_prompt_flags` (e.g. {"--json": True}) are options of the one-prompt mode
    only: given with -i or --input they are refused rather than silently ignored."""
    mode = "--interactive" if interactive else "--input"
    given = [name for name, on in (single_prompt_flags or {}).items() if on]
    if (interactive or input_path is not None) and given:
        raise fail(f"{', '.join(given)} only apply to a single prompt, not with {mode}; "
                   f"drop {'them' if len(given) > 1 else 'it'}")
    if interactive and input_path is not None:
        raise fail("--interactive and --input exclude each other; use one")
    if prompt is not None:
        raise fail("a prompt argument cannot be combined with "
                   + ("--interactive" if interactive else "--input") + "; drop one")
    if input_path is None and (output is not None or batch_size is not None):
        raise fail("--output and --batch-size only apply with --input FILE")


def run(flags: dict[str, Any], preset_ref: str | None, model_flags: ModelFlags,
        input_path: Path, output: str | None, batch_size: int | None, chat: bool,
        system: str | None) -> None:
    """Entry point from `genlab generate --input`."""
    from genlib import batch as gb
    from genlib.config import resolve_settings
    from genlib.presets import load_preset

    batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    if output is None:
        raise fail("--input needs --output FILE (or --output - for stdout)")
    if batch_size < 1:
        raise fail(f"--batch-size must be >= 1, got {batch_size}")
    if system and not chat:
        raise fail("--system needs --chat")
    out_path = None if output == "-" else Path(output)
    if out_path is not None and gb.same_file(input_path, out_path):
        raise fail("--output is the --input file; give another file for the results")
    preset = load_preset(preset_ref) if preset_ref else None
    resolve_settings(flags, preset.settings if preset else None)  # bad flags: fail once
    run_defaults = gb.RunDefaults(
        preset_settings=preset.settings if preset else {},
        flags={k: v for k, v in flags.items() if k != "seed"},
        seed=flags.get("seed", (preset.settings if preset else {}).get("seed", gb.DEFAULT_SEED)),
        chat=chat, system=system)
    items = gb.parse_lines(gb.read_input(input_path), run_defaults)
    done = _resume(out_path) if out_path is not None else {}
    tally = Tally(lines=len(items))
    writer = gb.ResultWriter.open(out_path) if out_path else gb.ResultWriter(sys.stdout)
    start = time.perf_counter()
    try:
        todo = _write_line_errors(items, done, writer, tally)
        if todo:
            lm = load(model_flags, preset, quick=batch_size == 1)
            _generate(lm, todo, run_defaults, batch_size, writer, tally)
    except KeyboardInterrupt:
        tally.interrupted = True
    finally:
        writer.close()
    _summary(tally, time.perf_counter() - start)
    if tally.interrupted:
        raise typer.Exit(INTERRUPTED)
    if tally.failed or tally.failed_before:
        raise typer.Exit(1)


def _resume(path: Path) -> dict[str, dict[str, Any]]:
    from cli import render
    from genlib.batch import scan_output

    done, cut = scan_output(path)
    if cut:
        render.warn(f"{path}: removed a half-written last line ({cut} bytes) left by an "
                    f"interrupted run; that line will be generated again")
    if done:
        render.info(f"resuming: {len(done)} results already in {path} are kept")
    return done


def _write_line_errors(items: list[Any], done: dict[str, dict[str, Any]],
                       writer: ResultWriter, tally: Tally) -> list[Job]:
    """Skip ids already done, write an error for each bad line; return the jobs to run."""
    from cli import render
    from genlib.batch import LineError, error_record, id_key

    todo = []
    for item in items:
        previous = done.get(id_key(item.id))
        if previous is not None:
            tally.skipped += 1
            tally.failed_before += "error" in previous
            continue
        if isinstance(item, LineError):
            render.error(item.message)
            writer.write(error_record(item.id, item.message))
            tally.failed += 1
        else:
            todo.append(item)
    return todo


def _encode_all(lm: Any, jobs: list[Job], writer: ResultWriter, tally: Tally,
                run_defaults: Any) -> list[Job]:
    from cli import render
    from genlib.batch import encode, error_record
    from genlib.errors import GenlabError

    ready = []
    for job in jobs:
        try:
            encode(lm, job, run_defaults)
        except GenlabError as exc:
            message = f"line {job.line}: {exc}"
            render.error(message)
            writer.write(error_record(job.id, message))
            tally.failed += 1
            continue
        ready.append(job)
    return ready


def _generate(lm: Any, jobs: list[Job], run_defaults: Any, batch_size: int,
              writer: ResultWriter, tally: Tally) -> None:
    from cli import render
    from genlib.batch import error_record, generate_jobs, result_record

    ready = _encode_all(lm, jobs, writer, tally, run_defaults)
    progress = _progress(len(jobs))
    task = progress.add_task("generating", total=len(jobs), tps="")
    progress.update(task, advance=len(jobs) - len(ready))
    start = time.perf_counter()
    with progress:
        for job, outcome in generate_jobs(lm, ready, batch_size):
            if isinstance(outcome, str):
                message = f"line {job.line}: {outcome}"
                render.error(message)
                writer.write(error_record(job.id, message))
                tally.failed += 1
            elif outcome.reason == "interrupted":
                tally.interrupted = True  # not written: a resumed run generates it again
                continue
            else:
                writer.write(result_record(job, outcome))
                tally.done += 1
                tally.tokens += outcome.new_tokens
            tally.generating_s = time.perf_counter() - start
            rate = tally.tokens / max(tally.generating_s, 1e-9)
            progress.update(task, advance=1, tps=f"{rate:,.0f} tok/s")


def _progress(total: int) -> Progress:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from cli.render import err

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[tps]}"), TimeRemainingColumn(), console=err,
                    disable=not err.is_terminal, transient=False)


def _summary(tally: Tally, seconds: float) -> None:
    from cli import render

    parts = [f"{tally.lines} lines", f"{tally.done} generated", f"{tally.failed} failed"]
    if tally.skipped:
        parts.append(f"{tally.skipped} already done"
                     + (f" ({tally.failed_before} of them failed)" if tally.failed_before
                        else ""))
    rate = tally.tokens / tally.generating_s if tally.generating_s > 0 else 0.0
    parts += [f"{tally.tokens:,} tokens", f"{seconds:.1f} s", f"{rate:,.0f} tok/s"]
    if tally.interrupted:
        parts.append("interrupted: rerun the same command to finish")
    render.info(" · ".join(parts))
