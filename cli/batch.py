"""`genlab generate --input prompts.jsonl --output results.jsonl`: generate for every
line of a JSONL file in real batches, resumable, with a progress bar on stderr.

The work (parsing, grouping, seeds, resume, writing) is genlib.batch.jobs; this module only
wires it to the terminal: progress, summary, exit code. Two engines produce the outcomes:
the local one (this process) and `--engine ray` (genlib.batch.ray_engine); both are recorded
by `_record_outcomes`, through the same writer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.context import ModelFlags, load
from cli.errors import INTERRUPTED, fail
from genlib.errors import not_one_of

if TYPE_CHECKING:
    from rich.progress import Progress

    from genlib.batch.jobs import Job, ResultsFile, ResumePlan, RunDefaults
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
        from genlib.batch.openai import FORMATS

        if self.engine not in ENGINES:
            raise fail(not_one_of("--engine", self.engine, ENGINES))
        if self.format not in FORMATS:
            raise fail(not_one_of("--format", self.format, FORMATS))
        ray_only = [name for name in self.given() if name in ("--ray-address", "--workers")]
        if ray_only and self.engine != "ray":
            raise fail(f"{' and '.join(ray_only)} only {_apply(ray_only)} with --engine ray")
        if self.workers is not None and self.workers < 1:
            raise fail(f"--workers must be >= 1, got {self.workers}")
        if self.ray_address is not None:
            from genlib.batch.ray_cluster import check_address

            check_address(self.ray_address)  # before the output file is touched


@dataclass
class Tally:
    """What the summary reports."""

    lines: int = 0
    done: int = 0
    failed: int = 0
    skipped: int = 0
    failed_before: int = 0
    redone: int = 0
    tokens: int = 0
    interrupted: bool = False
    generating_s: float = 0.0  # model loading excluded, for tokens/s


@dataclass(frozen=True)
class ResumeFlags:
    """What to do with earlier results that are not plainly done."""

    redo_changed: bool = False
    retry_errors: bool = False


def _apply(flags: list[str]) -> str:
    return "applies" if len(flags) == 1 else "apply"


def check_modes(prompt: str | None, interactive: bool, input_path: Path | None,
                output: str | None, batch_size: int | None,
                single_prompt_flags: dict[str, bool] | None = None,
                batch_flags: dict[str, bool] | None = None,
                engine: EngineFlags | None = None) -> None:
    """The ways to run `genlab generate` exclude each other; say which flag to drop.

    `single_prompt_flags` (e.g. {"--json": True}) are options of the one-prompt mode
    only: given with -i or --input they are refused rather than silently ignored;
    `batch_flags` (--retry-errors, ...) likewise need --input."""
    resume_only = [name for name, on in (batch_flags or {}).items() if on]
    if input_path is None and resume_only:
        raise fail(f"{', '.join(resume_only)} only {_apply(resume_only)} with --input FILE "
                   f"--output FILE")
    mode = "--interactive" if interactive else "--input"
    given = [name for name, on in (single_prompt_flags or {}).items() if on]
    if (interactive or input_path is not None) and given:
        raise fail(f"{', '.join(given)} only {_apply(given)} to a single prompt, not with {mode}; "
                   f"drop {'them' if len(given) > 1 else 'it'}")
    if interactive and input_path is not None:
        raise fail("--interactive and --input exclude each other; use one")
    if input_path is None:  # name what needs --input before blaming the prompt
        needs = (["--output"] if interactive and output is not None else []) \
            + (["--batch-size"] if batch_size is not None else []) \
            + (engine.given() if engine is not None else [])
        if needs:
            raise fail(f"{', '.join(needs)} only {_apply(needs)} with --input FILE")
    if prompt is not None:
        raise fail(f"a prompt argument cannot be combined with {mode}; drop one")
    if engine is not None:
        engine.check()


def run(flags: dict[str, Any], preset_ref: str | None, model_flags: ModelFlags,
        input_path: Path, output: str | None, batch_size: int | None, chat: bool,
        system: str | None, resume: ResumeFlags = ResumeFlags(),
        engine: EngineFlags | None = None, logprobs: int = 0,
        combined: dict[str, Any] | None = None) -> None:
    """Entry point from `genlab generate --input`; `logprobs` N > 0 (--logprobs) gives
    every line's result its tokens' logprobs with N alternatives (a line's own
    `logprobs` wins); `combined`: the settings --ensemble/--amateur imply, under the
    run's preset (a line may set the numbers, never the models)."""
    from genlib.batch import jobs as gb
    from genlib.batch import openai as openai_batch
    from genlib.models.loading import resolve_model_ref
    from genlib.settings.config import resolve_settings
    from genlib.settings.presets import load_preset

    if output is None:
        raise fail("--input needs --output FILE (or --output - for stdout)")
    if batch_size is not None and batch_size < 1:
        raise fail(f"--batch-size must be >= 1, got {batch_size}")
    if system and not chat:
        raise fail("--system needs --chat")
    batch_size = _rows_per_forward(batch_size, model_flags.backend)
    out_path = None if output == "-" else Path(output)
    if out_path is not None and gb.same_file(input_path, out_path):
        raise fail("--output is the --input file; give another file for the results")
    if out_path is not None:
        from cli.paths import check_output_path

        check_output_path(out_path, "--output")
    preset = load_preset(preset_ref) if preset_ref else None
    preset_settings = {**(combined or {}), **(preset.settings if preset else {})}
    # bad flags: fail once, not on every line
    run_settings = resolve_settings(flags, preset_settings)
    gb.check_one_result(run_settings.num_return_sequences,
                        "--num-return-sequences (or --preset)")
    gb.check_line_rerank(run_settings, "--rerank (or --preset)")
    model_ref = resolve_model_ref(model_flags.model, preset.model if preset else None)
    run_defaults = gb.RunDefaults(
        preset_settings=preset_settings,
        flags={k: v for k, v in flags.items() if k != "seed"},
        seed=flags.get("seed", (preset.settings if preset else {}).get("seed", gb.DEFAULT_SEED)),
        chat=chat, system=system,
        model=gb.model_identity(model_ref, model_flags.dtype, model_flags.quantize)
        + partners_identity(model_flags),
        logprobs=logprobs)
    engine = engine or EngineFlags()
    if engine.engine == "ray" and model_flags.combined:
        raise fail("--engine ray loads one model per worker; run --ensemble and --amateur "
                   "with --engine local")
    if engine.engine == "ray":
        from genlib.batch.ray_engine import require_ray

        require_ray(engine.ray_address is None)  # not installed: say how, before anything
    lines = gb.read_input(input_path)
    in_format = engine.format if engine.format != "auto" else openai_batch.detect(lines)
    out_format = _output_format(out_path, engine.format, in_format)
    adapt = openai_batch.to_genlab_line if in_format == "openai" else None
    items = gb.parse_lines(lines, run_defaults, adapt)
    if not items:
        from cli import render

        render.warn(f"{'stdin' if str(input_path) == '-' else input_path} has no lines to run: "
                    f"nothing to generate")
    tally = Tally(lines=len(items))
    results = gb.ResultsFile.open(out_path) if out_path else gb.ResultsFile.stdout()
    if out_format == "openai":
        results.in_format(openai_batch.line_writer(
            _endpoints(items, chat and in_format == "genlab"), model_ref),
            openai_batch.record_of)
    start = time.perf_counter()
    with results:
        plan = _resume(results, items, resume, tally)
        try:
            todo = _write_line_errors(items, plan, results, tally)
            if todo and engine.engine == "ray":
                _run_ray(todo, lines, run_defaults, model_flags, model_ref, batch_size,
                         adapt, engine, results, tally)
            elif todo:
                lm = load(model_flags, preset)
                _generate(lm, todo, run_defaults, batch_size, results, tally,
                          model_flags.backend)
        except KeyboardInterrupt:
            tally.interrupted = True
        results.check()  # what the summary counts is still in the file
    _summary(tally, time.perf_counter() - start)
    if tally.interrupted:
        raise typer.Exit(INTERRUPTED)
    if tally.failed or tally.failed_before:
        raise typer.Exit(1)


def partners_identity(model_flags: ModelFlags) -> str:
    """The combined models as a line's fingerprint names them (they change its text)."""
    from genlib.batch import jobs as gb
    from genlib.sampling.combine import parse_member

    members = [parse_member(text) for text in model_flags.ensemble]
    named = [f" + ensemble {gb.model_identity(ref)}:{weight:g}" for ref, weight in members]
    if model_flags.amateur:
        named.append(f" - amateur {gb.model_identity(model_flags.amateur)}")
    return "".join(named)


def _rows_per_forward(batch_size: int | None, backend: str) -> int:
    """--batch-size (None: not given, DEFAULT_BATCH_SIZE), or 1 on a backend that runs one
    row per forward, said once where --batch-size asked for more."""
    from cli import render
    from genlib.backends.choose import ONE_ROW, check_name

    if check_name(backend) not in ONE_ROW:
        return DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    if batch_size is not None and batch_size > 1:
        render.info(f"--backend {backend} runs one row per forward, so the lines run one by "
                    f"one (--batch-size {batch_size} is not used; --backend auto batches "
                    f"them)")
    return 1


def _resume(results: ResultsFile, items: list[Any], resume: ResumeFlags, tally: Tally
            ) -> ResumePlan:
    """Lock the results file, read what it holds and decide what to run; before any
    work, so a busy or stale file stops the run with nothing generated."""
    from cli import render
    from genlib.batch.jobs import id_key, plan_resume

    if results.resumable and not results.lock():
        render.warn("this platform has no file locks: make sure no other run writes "
                    f"{results.name}")
    elif not results.resumable and results.path is not None:
        render.info(f"{results.name} is not a regular file: results are streamed to it, "
                    f"and a rerun starts over")
    prior = results.read()
    if results.repaired_bytes:
        render.warn(f"{results.name}: removed a half-written last line "
                    f"({results.repaired_bytes} bytes) left by an interrupted run; that "
                    f"line will be generated again")
    wanted = {id_key(item.id): item.fingerprint for item in items}
    plan = plan_resume(wanted, prior, redo_changed=resume.redo_changed,
                       retry_errors=resume.retry_errors)
    results.drop(plan.drop)
    tally.skipped, tally.failed_before = len(plan.kept), plan.failed_before
    tally.redone = len(plan.drop)
    if plan.kept:
        render.info(f"resuming: {len(plan.kept)} results already in {results.name} are kept")
    if plan.drop:
        render.info(f"generating again: {len(plan.changed)} changed line(s), "
                    f"{len(plan.drop) - len(plan.changed)} earlier error(s)")
    if plan.orphans:
        render.warn(f"{results.name} holds {plan.orphans} result(s) for ids no input line "
                    f"has; they are left as they are")
    return plan


def _output_format(out_path: Path | None, forced: str, in_format: str) -> str:
    """The results' format: the one the output file already holds (a resumed run keeps
    it), else --format, else the input's."""
    from genlib.batch.openai import results_format

    found = results_format(out_path) if out_path is not None else None
    if found is not None and forced != "auto" and found != forced:
        raise fail(f"--format {forced}: {out_path} already holds results in {found} format; "
                   f"give another --output file, or --format {found}")
    return found or in_format


def _endpoints(items: Iterable[Any], chat: bool) -> dict[str, str]:
    from genlib.batch.jobs import Job, id_key
    from genlib.batch.openai import endpoint_for

    return {id_key(item.id): endpoint_for(item.messages is not None, chat)
            for item in items if isinstance(item, Job)}


def _write_line_errors(items: list[Any], plan: ResumePlan, results: ResultsFile,
                       tally: Tally) -> list[Job]:
    """Write an error for each bad line to run; return the jobs to generate."""
    from cli import render
    from genlib.batch.jobs import LineError, error_record, id_key

    run = set(plan.run)
    todo = []
    for item in items:
        if id_key(item.id) not in run:
            continue
        if isinstance(item, LineError):
            render.error(item.message)
            results.append(error_record(item, item.message))
            tally.failed += 1
        else:
            todo.append(item)
    return todo


def _encode_all(lm: Any, jobs: list[Job], results: ResultsFile, tally: Tally,
                run_defaults: Any) -> list[Job]:
    """Tokenize each job; a line that cannot be (too long, no chat template, a fault
    of the tokenizer) gets its error record and the others go on."""
    from cli import render
    from genlib.batch.jobs import encode, error_record
    from genlib.errors import GenlabError, unexpected

    ready = []
    for job in jobs:
        try:
            encode(lm, job, run_defaults)
        except Exception as exc:  # noqa: BLE001  (isolation: one line's fault is its own)
            reason = str(exc) if isinstance(exc, GenlabError) else unexpected(exc)
            message = f"line {job.line}: {reason}"
            render.error(message)
            results.append(error_record(job, message))
            tally.failed += 1
            continue
        ready.append(job)
    return ready


def _generate(lm: Any, jobs: list[Job], run_defaults: Any, batch_size: int,
              results: ResultsFile, tally: Tally, backend: str) -> None:
    """The local engine: encode here, generate here, on the user's `backend`; a backend
    that cannot serve even one row is refused once, before any line."""
    from genlib.backends.choose import Request, backend_name
    from genlib.batch.jobs import generate_jobs

    backend_name(lm, Request(backend=backend))
    ready = _encode_all(lm, jobs, results, tally, run_defaults)
    _record_outcomes(generate_jobs(lm, ready, batch_size, backend), len(jobs),
                     len(jobs) - len(ready), results, tally)


def _run_ray(jobs: list[Job], lines: list[str], run_defaults: RunDefaults,
             model_flags: ModelFlags, model_ref: str, batch_size: int, adapt: Any,
             engine: EngineFlags, results: ResultsFile, tally: Tally) -> None:
    """The Ray engine: the workers encode and generate, this process records (through
    the same locked results file, with the fingerprints the driver computed)."""
    from cli import render
    from genlib.backends.choose import check_name
    from genlib.batch.ray_engine import WorkerPlan, run_on_ray
    from genlib.models.info import ModelSpec

    ref = model_ref
    if Path(ref).expanduser().exists():  # workers may start in other folders
        ref = str(Path(ref).expanduser().resolve())
    spec = ModelSpec(ref=ref, device=model_flags.device, dtype=model_flags.dtype,
                     quantize=model_flags.quantize,
                     trust_remote_code=model_flags.trust_remote_code,
                     backend=check_name(model_flags.backend))
    plan = WorkerPlan(spec=spec, run=run_defaults, batch_size=batch_size, adapt=adapt)
    outcomes = run_on_ray(jobs, lines, plan, engine.workers, engine.ray_address,
                          note=render.warn)
    _record_outcomes(outcomes, len(jobs), 0, results, tally)


def _record_outcomes(outcomes: Iterable[tuple[Job, Finish | str]], total: int, failed: int,
                     results: ResultsFile, tally: Tally) -> None:
    """Write each job's outcome as it comes (either engine), with a progress bar over
    `total` jobs of which `failed` already had their error written."""
    from cli import render
    from genlib.batch.jobs import error_record, result_record

    progress = _progress(total)
    task = progress.add_task("generating", total=total, tps="")
    progress.update(task, advance=failed)
    start = time.perf_counter()
    with progress:
        for job, outcome in outcomes:
            if isinstance(outcome, str):
                message = f"line {job.line}: {outcome}"
                render.error(message)
                results.append(error_record(job, message))
                tally.failed += 1
            elif outcome.reason == "interrupted":
                tally.interrupted = True  # not written: a resumed run generates it again
                continue
            else:
                results.append(result_record(job, outcome))
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

    parts = [render.counted(tally.lines, "line"), f"{tally.done} generated",
             f"{tally.failed} failed"]
    if tally.skipped:
        parts.append(f"{tally.skipped} already done"
                     + (f" ({tally.failed_before} of them failed)" if tally.failed_before
                        else ""))
        if tally.failed_before:
            parts.append("--retry-errors runs the failed ones again")
    if tally.redone:
        parts.append(f"{tally.redone} redone")
    rate = tally.tokens / tally.generating_s if tally.generating_s > 0 else 0.0
    parts += [f"{tally.tokens:,} tokens", f"{seconds:.1f} s", f"{rate:,.0f} tok/s"]
    if tally.interrupted:
        parts.append("interrupted: rerun the same command to finish")
    render.info(" · ".join(parts))
