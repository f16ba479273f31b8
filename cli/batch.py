"""`genlab generate --input prompts.jsonl --output results.jsonl`: generate for every
line of a JSONL file in real batches, resumable, with a progress bar on stderr.

The work (parsing, grouping, seeds, resume, writing) is genlib.batch; this module only
wires it to the terminal: progress, summary, exit code. Two engines produce the outcomes:
the local one (this process) and `--engine ray` (genlib.ray_engine); both are recorded
by `_record_outcomes`, through the same writer.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.context import ModelFlags, load
from cli.errors import INTERRUPTED, fail

if TYPE_CHECKING:
    from rich.progress import Progress

    from genlib.batch import Job, ResultWriter, RunDefaults
    from genlib.events import Finish


DEFAULT_BATCH_SIZE = 16
ENGINES = ("local", "ray")


@dataclass(frozen=True)
class EngineFlags:
    """Where the lines run and in which file format: --engine, --ray-address, --workers,
    --format."""

    engine: str = "local"
    ray_address: str | None = None
    workers: int | None = None
    format: str = "auto"

    def given(self) -> list[str]:
        """The flags given with other than their defaults (they need --input)."""
        return [name for name, on in (("--engine", self.engine != "local"),
                                      ("--ray-address", self.ray_address is not None),
                                      ("--workers", self.workers is not None),
                                      ("--format", self.format != "auto")) if on]

    def check(self) -> None:
        from genlib.openai_batch import FORMATS

        if self.engine not in ENGINES:
            raise fail(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.format not in FORMATS:
            raise fail(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        ray_only = [name for name in self.given() if name in ("--ray-address", "--workers")]
        if ray_only and self.engine != "ray":
            raise fail(f"{' and '.join(ray_only)} only {_apply(ray_only)} with --engine ray")
        if self.workers is not None and self.workers < 1:
            raise fail(f"--workers must be >= 1, got {self.workers}")


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


def _apply(flags: list[str]) -> str:
    return "applies" if len(flags) == 1 else "apply"


def check_modes(prompt: str | None, interactive: bool, input_path: Path | None,
                output: str | None, batch_size: int | None,
                single_prompt_flags: dict[str, bool] | None = None,
                engine: EngineFlags | None = None) -> None:
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
    batch_only = engine.given() if engine is not None else []
    if input_path is None and batch_only:
        raise fail(f"{', '.join(batch_only)} only {_apply(batch_only)} with --input FILE")
    if engine is not None:
        engine.check()


def run(flags: dict[str, Any], preset_ref: str | None, model_flags: ModelFlags,
        input_path: Path, output: str | None, batch_size: int | None, chat: bool,
        system: str | None, engine: EngineFlags | None = None) -> None:
    """Entry point from `genlab generate --input`."""
    from genlib import batch as gb
    from genlib import openai_batch
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
    engine = engine or EngineFlags()
    if engine.engine == "ray":
        from genlib.ray_engine import require_ray

        require_ray(engine.ray_address is None)  # not installed: say how, before anything
    lines = gb.read_input(input_path)
    in_format = engine.format if engine.format != "auto" else openai_batch.detect(lines)
    out_format = _output_format(out_path, engine.format, in_format)
    adapt = openai_batch.to_genlab_line if in_format == "openai" else None
    items = gb.parse_lines(lines, run_defaults, adapt)
    done = _resume(out_path, out_format) if out_path is not None else {}
    tally = Tally(lines=len(items))
    line_of = None
    if out_format == "openai":
        line_of = openai_batch.line_writer(_endpoints(items, chat and in_format == "genlab"),
                                           _model_ref(model_flags, preset))
    writer = gb.ResultWriter.open(out_path, line_of=line_of) if out_path else \
        gb.ResultWriter(sys.stdout, line_of=line_of)
    start = time.perf_counter()
    try:
        todo = _write_line_errors(items, done, writer, tally)
        if todo and engine.engine == "ray":
            _run_ray(todo, lines, run_defaults, model_flags, preset, batch_size, adapt,
                     engine, writer, tally)
        elif todo:
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


def _output_format(out_path: Path | None, forced: str, in_format: str) -> str:
    """The results' format: the one the output file already holds (a resumed run keeps
    it), else --format, else the input's."""
    from genlib.openai_batch import results_format

    found = results_format(out_path) if out_path is not None else None
    if found is not None and forced != "auto" and found != forced:
        raise fail(f"--format {forced}: {out_path} already holds results in {found} format; "
                   f"give another --output file, or --format {found}")
    return found or in_format


def _endpoints(items: Iterable[Any], chat: bool) -> dict[str, str]:
    from genlib.batch import Job, id_key
    from genlib.openai_batch import endpoint_for

    return {id_key(item.id): endpoint_for(item.messages is not None, chat)
            for item in items if isinstance(item, Job)}


def _model_ref(model_flags: ModelFlags, preset: Any) -> str:
    """The model as the command names it (--model, the preset's, the default)."""
    from genlib.models import resolve_model_ref

    return resolve_model_ref(model_flags.model, preset.model if preset else None)


def _resume(path: Path, out_format: str = "genlab") -> dict[str, dict[str, Any]]:
    from cli import render
    from genlib.batch import scan_output
    from genlib.openai_batch import record_of

    done, cut = scan_output(path, record_of if out_format == "openai" else None)
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
    """The local engine: encode here, generate here."""
    from genlib.batch import generate_jobs

    ready = _encode_all(lm, jobs, writer, tally, run_defaults)
    _record_outcomes(generate_jobs(lm, ready, batch_size), len(jobs), len(jobs) - len(ready),
                     writer, tally)


def _run_ray(jobs: list[Job], lines: list[str], run_defaults: RunDefaults,
             model_flags: ModelFlags, preset: Any, batch_size: int, adapt: Any,
             engine: EngineFlags, writer: ResultWriter, tally: Tally) -> None:
    """The Ray engine: the workers encode and generate, this process records."""
    from genlib.models import ModelSpec
    from genlib.ray_engine import WorkerPlan, run_on_ray

    ref = _model_ref(model_flags, preset)
    if Path(ref).expanduser().exists():  # workers may start in other folders
        ref = str(Path(ref).expanduser().resolve())
    spec = ModelSpec(ref=ref, device=model_flags.device, dtype=model_flags.dtype,
                     quantize=model_flags.quantize,
                     trust_remote_code=model_flags.trust_remote_code)
    plan = WorkerPlan(spec=spec, run=run_defaults, batch_size=batch_size, adapt=adapt,
                      quick=batch_size == 1)
    outcomes = run_on_ray(jobs, lines, plan, engine.workers, engine.ray_address)
    _record_outcomes(outcomes, len(jobs), 0, writer, tally)


def _record_outcomes(outcomes: Iterable[tuple[Job, Finish | str]], total: int, failed: int,
                     writer: ResultWriter, tally: Tally) -> None:
    """Write each job's outcome as it comes (either engine), with a progress bar over
    `total` jobs of which `failed` already had their error written."""
    from cli import render
    from genlib.batch import error_record, result_record

    progress = _progress(total)
    task = progress.add_task("generating", total=total, tps="")
    progress.update(task, advance=failed)
    start = time.perf_counter()
    with progress:
        for job, outcome in outcomes:
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
