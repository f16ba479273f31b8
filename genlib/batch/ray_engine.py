"""The Ray engine for JSONL batch runs: the same lines, settings, seeds and decode as the
local engine (genlib.batch.jobs), spread over the workers of a Ray cluster with Ray Data.

The driver keeps everything that touches the output file: it parses the input (to know
the ids and skip those done), hands the remaining lines to Ray Data, and gets each line's
outcome back as `(job, Finish | error message)`, exactly what `genlib.batch.jobs.generate_jobs`
yields, so the caller records both engines' results with the same code.

Each worker is a Ray Data actor (`GenerateWorker`, `map_batches` over a fixed actor pool)
that loads the model once (on the spec's backend), then for each batch of lines runs the
local engine's own functions: `parse_line`, `encode` and `generate_jobs`. A line's seed
comes from the run seed and its id, never from where it ran, so its text is the local
engine's; its fingerprint is the one the driver computed, so the results file cannot
tell which engine wrote a record (a line the worker parses otherwise, say with a preset
that differs on its node, is that line's error). A worker that cannot load the model
says so as data, which the driver turns into one error line.

If a worker dies, Ray restarts it and runs its batch again; rows of a batch that had
already come back are dropped here, so each line yields once. Starting or joining the
cluster, and how many workers it has room for, is genlib.batch.ray_cluster's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genlib.batch.jobs import (
    Job,
    LineAdapter,
    LineError,
    RunDefaults,
    encode,
    generate_jobs,
    parse_line,
)
from genlib.batch.ray_cluster import RayEngineError, connect, pool_size, require_ray
from genlib.errors import GenlabError, UserInputError, show_genlab_warnings, unexpected

if TYPE_CHECKING:
    from genlib.events import Finish
    from genlib.models.info import LoadedModel, ModelSpec

# A batch whose worker dies is run again on a restarted worker this many times at most
# (a line that kills every worker it meets must not loop for ever).
MAX_RETRIES = 3


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker needs, sent once to each: the model to load and the run's own
    settings, under which each line is parsed as the driver parsed it."""

    spec: ModelSpec
    run: RunDefaults
    batch_size: int
    adapt: LineAdapter | None = None  # module-level functions only: it travels by pickle
    quick: bool = True
    cpus: int = 1  # torch threads per worker: the CPUs Ray reserves for it


# ---------------------------------------------------------------- worker side


# A line that the worker parses into other settings than the driver did: generated, its
# record would name the driver's settings and fingerprint beside the worker's text.
SETTINGS_DIFFER = ("its settings on the Ray worker differ from those here (a preset of "
                   "the same name that differs between the nodes, or another genlab "
                   "version); make presets and genlab the same on every node")

# A worker's input row: line number, the line as read, the fingerprint the driver gave it.
Row = tuple[int, str, str]


def generate_lines(lm: LoadedModel, numbered: Sequence[Row], plan: WorkerPlan
                   ) -> list[tuple[int, dict[str, Any]]]:
    """A worker's batch: rows -> (line number, outcome), where an outcome is
    {"finish": Finish's fields} or {"error": message without the line}."""
    out: list[tuple[int, dict[str, Any]]] = []
    ready: list[Job] = []
    for number, text, driver_fingerprint in numbered:
        item = parse_line(text, number, plan.run, plan.adapt)
        if isinstance(item, LineError):  # the driver parsed it fine: a worker's own files
            out.append((number, {"error": item.message.removeprefix(f"line {number}: ")}))
            continue
        if item.fingerprint != driver_fingerprint:
            out.append((number, {"error": SETTINGS_DIFFER}))
            continue
        try:
            encode(lm, item, plan.run)
        except Exception as exc:  # noqa: BLE001  (isolation, as the local engine's)
            out.append((number, {"error": str(exc) if isinstance(exc, GenlabError)
                                 else unexpected(exc)}))
            continue
        ready.append(item)
    for job, outcome in generate_jobs(lm, ready, plan.batch_size, plan.spec.backend):
        if isinstance(outcome, str):
            out.append((job.line, {"error": outcome}))
        else:
            out.append((job.line, {"finish": dataclasses.asdict(outcome)}))
    return out


def load_failed(numbered: Sequence[Row], message: str
                ) -> list[tuple[int, dict[str, Any]]]:
    """A batch given to a worker that could not load the model: every line's outcome is
    {"load_error": message}, on which the driver stops the run with that message. Raised
    in the worker's constructor instead, the error would reach the driver as Ray's
    (its traceback printed twice, the message naming neither the model nor the cause)."""
    return [(number, {"load_error": message}) for number, *_ in numbered]


def say_warning(message: str) -> None:
    """A worker's GenlabWarning (genlib.errors) as the CLI words it, `warning: ...` on
    stderr, which Ray forwards to the driver's."""
    print(f"warning: {message}", file=sys.stderr)


class GenerateWorker:
    """A Ray Data actor: loads the model once, then generates every batch it is given
    (columns `line`, `text` and `fingerprint` in, `line` and `outcome` as JSON out)."""

    def __init__(self, plan: WorkerPlan):
        import torch

        from genlib.models.loading import freeze_heap, load_model

        torch.set_num_threads(max(1, plan.cpus))
        # Ray forwards a worker's stdout to the driver's, which may be the results
        # (--output -): anything a library prints goes to stderr instead.
        sys.stdout = sys.stderr
        show_genlab_warnings(say_warning)
        self.plan = plan
        self.lm: LoadedModel | None = None
        self.load_error: str | None = None
        try:
            self.lm = load_model(plan.spec, quick=plan.quick)
            freeze_heap()  # the worker's process is genlab's alone
        except Exception as exc:  # noqa: BLE001  (sent back as data: see load_failed)
            self.load_error = str(exc) if isinstance(exc, GenlabError) else unexpected(exc)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        numbered = [(int(n), str(t), str(f)) for n, t, f
                    in zip(batch["line"], batch["text"], batch["fingerprint"])]
        if self.lm is None:
            done = load_failed(numbered, self.load_error or "")
        else:
            done = generate_lines(self.lm, numbered, self.plan)
        return {"line": np.array([n for n, _ in done], dtype=np.int64),
                "outcome": np.array([json.dumps(o) for _, o in done], dtype=object)}


# ---------------------------------------------------------------- driver side


def run_on_ray(jobs: Sequence[Job], lines: Sequence[str], plan: WorkerPlan,
               workers: int | None = None, address: str | None = None,
               worker: type = GenerateWorker, note: Callable[[str], None] | None = None
               ) -> Iterator[tuple[Job, Finish | str]]:
    """Every job's outcome as its batch comes back from the cluster: (job, Finish) or
    (job, error message), each job once. `lines[n - 1]` is input line n, as read.
    `workers` defaults to as many as the cluster's nodes have room for; `note` is told
    when the run has to wait for room (genlib.batch.ray_cluster.pool_size).

    `worker` is the actor class (tests pass one that dies on purpose)."""
    if workers is not None and workers < 1:
        raise UserInputError(f"--workers must be >= 1, got {workers}")
    if not jobs:
        return
    started = connect(address)
    before = set(threading.enumerate())
    ended = False
    try:
        size = pool_size(require_ray(), worker_needs(plan), workers, note)
        yield from _stream(jobs, lines, plan, size, worker)
        ended = True
    finally:
        if started:
            if not ended:  # stopped midway: Ctrl-C, SIGTERM, an error
                let_threads_end(before, DATA_THREADS_GRACE)
            require_ray().shutdown()


# Seconds a run stopped midway gives the threads Ray Data started before ray.shutdown().
DATA_THREADS_GRACE = 2.0


def let_threads_end(before: set[threading.Thread], grace: float) -> None:
    """Wait up to `grace` seconds in all for the threads started since `before` to end.
    Ray Data's prefetching threads, told to stop when its iterator closes, may still be
    inside a ray.get (Ray does not join them, its own comment says); ray.shutdown() under
    one of them ends the whole process with status 1 ("the core worker has already been
    shutdown"), taking a SIGTERM'd run's summary and exit status with it."""
    deadline = time.monotonic() + grace
    for thread in set(threading.enumerate()) - before:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def worker_needs(plan: WorkerPlan) -> dict[str, float]:
    """What Ray reserves for each worker: its CPUs, and one GPU for a CUDA model."""
    needs = {"CPU": float(plan.cpus)}
    if plan.spec.device.startswith("cuda"):
        needs["GPU"] = 1.0
    return needs


def _stream(jobs: Sequence[Job], lines: Sequence[str], plan: WorkerPlan, workers: int,
            worker: type) -> Iterator[tuple[Job, Finish | str]]:
    ray = require_ray()
    # The CLI draws its own progress bar; Ray Data's bars and per-run notes would
    # interleave with it on stderr (its warnings and errors still show).
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    by_line = {job.line: job for job in jobs}
    rows = [{"line": job.line, "text": lines[job.line - 1], "fingerprint": job.fingerprint}
            for job in jobs]
    # One block per batch: each worker task is one batch, so a result comes back (and a
    # retry after a crash repeats) one batch at a time.
    blocks = math.ceil(len(rows) / plan.batch_size)
    dataset = ray.data.from_items(rows, override_num_blocks=blocks)
    workers = min(workers, blocks)  # a worker without a batch would only load the model
    with warnings.catch_warnings():
        # Ray 2.60 names no parameter for bounded restarts and retries (its own default
        # is to retry for ever); its remote arguments still set them, with a warning.
        warnings.simplefilter("ignore", DeprecationWarning)
        outcomes = dataset.map_batches(
            worker, fn_constructor_kwargs={"plan": plan}, batch_size=plan.batch_size,
            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=plan.cpus,
            num_gpus=worker_needs(plan).get("GPU"),
            max_restarts=MAX_RETRIES, max_task_retries=MAX_RETRIES)
    try:
        for number, outcome in first_of_each(outcomes.iter_rows()):
            yield by_line[number], _outcome(json.loads(outcome))
    except ray.exceptions.RayError as exc:
        reason = _reason(exc).rstrip(".")
        raise RayEngineError(f"the Ray run failed: {reason}; the results so far are kept, "
                             f"rerun the same command to finish") from None


def first_of_each(rows: Iterable[Mapping[str, Any]]) -> Iterator[tuple[int, str]]:
    """(line, outcome) of each row whose line has not come before: a batch that Ray ran
    again after its worker died may send rows that had come back already."""
    seen: set[int] = set()
    for row in rows:
        number = int(row["line"])
        if number not in seen:
            seen.add(number)
            yield number, row["outcome"]


def _outcome(data: dict[str, Any]) -> Finish | str:
    """A worker's outcome as the local engine yields it: an error message, or the
    LineFinish (its logprobs object, a JSON object, as it came)."""
    from genlib.batch.jobs import LineFinish

    if "load_error" in data:
        raise RayEngineError(f"a Ray worker cannot load the model: {data['load_error']}")
    if "error" in data:
        return str(data["error"])
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data["finish"].items()}
    return LineFinish(**fields)


def _reason(exc: BaseException) -> str:
    """Why a Ray run failed: the first line of Ray's message (the rest is its traceback)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
