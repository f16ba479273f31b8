"""The Ray engine for JSONL batch runs: the same lines, settings, seeds and decode as the
local engine (genlib.batch), spread over the workers of a Ray cluster with Ray Data.

The driver keeps everything that touches the output file: it parses the input (to know
the ids and skip those done), hands the remaining lines to Ray Data, and gets each line's
outcome back as `(job, Finish | error message)`, exactly what `genlib.batch.generate_jobs`
yields, so the caller records both engines' results with the same code.

Each worker is a Ray Data actor (`GenerateWorker`, `map_batches` over a fixed actor pool)
that loads the model once (on the spec's backend), then for each batch of lines runs the
local engine's own functions: `parse_line`, `encode` and `generate_jobs`. A line's seed
comes from the run seed and its id, never from where it ran, so its text is the local
engine's; its fingerprint is the one the driver computed, so the results file cannot
tell which engine wrote a record.

If a worker dies, Ray restarts it and runs its batch again; rows of a batch that had
already come back are dropped here, so each line yields once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genlib.batch import (
    Job,
    LineAdapter,
    LineError,
    RunDefaults,
    encode,
    generate_jobs,
    parse_line,
)
from genlib.errors import GenlabError, UserInputError, unexpected

if TYPE_CHECKING:
    from genlib.events import Finish
    from genlib.modelinfo import LoadedModel, ModelSpec

INSTALL_HINT = 'install it with: pip install "genlab[ray]" (in a checkout: pip install ".[ray]")'
# A batch whose worker dies is run again on a restarted worker this many times at most
# (a line that kills every worker it meets must not loop for ever).
MAX_RETRIES = 3


class RayMissingError(UserInputError):
    """--engine ray was asked for but Ray (with Ray Data) is not installed."""


class RayEngineError(GenlabError):
    """The Ray cluster could not be reached or the distributed run failed."""


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker needs, sent once to each: the model to load and the run's own
    settings, under which each line is parsed as the driver parsed it."""

    spec: ModelSpec
    run: RunDefaults
    batch_size: int
    adapt: LineAdapter | None = None  # module-level functions only: it travels by pickle
    quick: bool = False
    cpus: int = 1  # torch threads per worker: the CPUs Ray reserves for it


def require_ray(private_cluster: bool = False) -> Any:
    """The ray module, or RayMissingError saying how to install it. `private_cluster`:
    the run will start its own one-machine cluster (no --ray-address), so keep it on the
    loopback address (no other node can join it anyway) and report no usage anywhere;
    Ray reads both when it is first imported."""
    if private_cluster:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
        import ray.data  # noqa: F401 - the "data" extra: pyarrow, pandas
    except ImportError as exc:
        raise RayMissingError(f"--engine ray needs Ray with Ray Data ({exc.name} is not "
                              f"installed); {INSTALL_HINT}") from None
    return ray


# ---------------------------------------------------------------- worker side


def generate_lines(lm: LoadedModel, numbered: Sequence[tuple[int, str]], plan: WorkerPlan
                   ) -> list[tuple[int, dict[str, Any]]]:
    """A worker's batch: (line number, text) pairs -> (line number, outcome), where an
    outcome is {"finish": Finish's fields} or {"error": message without the line}."""
    out: list[tuple[int, dict[str, Any]]] = []
    ready: list[Job] = []
    for number, text in numbered:
        item = parse_line(text, number, plan.run, plan.adapt)
        if isinstance(item, LineError):  # the driver parsed it fine: a worker's own files
            out.append((number, {"error": item.message.removeprefix(f"line {number}: ")}))
            continue
        try:
            encode(lm, item, plan.run)
        except Exception as exc:  # noqa: BLE001  (isolation, as the local engine's)
            out.append((number, {"error": str(exc) if isinstance(exc, GenlabError)
                                 else unexpected(exc)}))
            continue
        ready.append(item)
    for job, outcome in generate_jobs(lm, ready, plan.batch_size):
        if isinstance(outcome, str):
            out.append((job.line, {"error": outcome}))
        else:
            out.append((job.line, {"finish": dataclasses.asdict(outcome)}))
    return out


class GenerateWorker:
    """A Ray Data actor: loads the model once, then generates every batch it is given
    (columns `line` and `text` in, `line` and `outcome` as JSON out)."""

    def __init__(self, plan: WorkerPlan):
        import torch

        from genlib.models import load_model

        torch.set_num_threads(max(1, plan.cpus))
        # Ray forwards a worker's stdout to the driver's, which may be the results
        # (--output -): anything a library prints goes to stderr instead.
        sys.stdout = sys.stderr
        self.plan = plan
        self.lm = load_model(plan.spec, quick=plan.quick)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        numbered = [(int(n), str(t)) for n, t in zip(batch["line"], batch["text"])]
        done = generate_lines(self.lm, numbered, self.plan)
        return {"line": np.array([n for n, _ in done], dtype=np.int64),
                "outcome": np.array([json.dumps(o) for _, o in done], dtype=object)}


# ---------------------------------------------------------------- driver side


def connect(address: str | None, cpus: int | None = None) -> bool:
    """Join the cluster at `address` ("auto": the one `ray start` runs here), or start a
    private one on this machine (loopback only) when there is none. True if this call
    started Ray (the caller shuts it down). A Ray already initialised is used as it is."""
    ray = require_ray(private_cluster=address is None)
    if ray.is_initialized():
        return False
    try:
        # "local": a new cluster even where `ray start` runs one (ray.init's default
        # would join that), so a run without --ray-address never lands on another's.
        ray.init(address=address or "local", num_cpus=cpus if address is None else None,
                 include_dashboard=False, logging_level="ERROR", log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise RayEngineError(f"cannot start or join {where} ({_first_line(exc)}); start one "
                             f"with `ray start --head` and pass --ray-address auto") from None
    return True


def run_on_ray(jobs: Sequence[Job], lines: Sequence[str], plan: WorkerPlan,
               workers: int | None = None, address: str | None = None,
               worker: type = GenerateWorker) -> Iterator[tuple[Job, Finish | str]]:
    """Every job's outcome as its batch comes back from the cluster: (job, Finish) or
    (job, error message), each job once. `lines[n - 1]` is input line n, as read.
    `workers` defaults to as many as the cluster has room for.

    `worker` is the actor class (tests pass one that dies on purpose)."""
    if workers is not None and workers < 1:
        raise UserInputError(f"--workers must be >= 1, got {workers}")
    if not jobs:
        return
    started = connect(address)
    try:
        yield from _stream(jobs, lines, plan, workers or default_workers(plan), worker)
    finally:
        if started:
            require_ray().shutdown()


def default_workers(plan: WorkerPlan) -> int:
    """As many workers as the cluster's CPUs (GPUs for a CUDA model) hold, at least one."""
    resources = require_ray().cluster_resources()
    if plan.spec.device.startswith("cuda"):
        return max(1, int(resources.get("GPU", 0)))
    return max(1, int(resources.get("CPU", 0)) // plan.cpus)


def _stream(jobs: Sequence[Job], lines: Sequence[str], plan: WorkerPlan, workers: int,
            worker: type) -> Iterator[tuple[Job, Finish | str]]:
    ray = require_ray()
    # The CLI draws its own progress bar; Ray Data's bars and per-run notes would
    # interleave with it on stderr (its warnings and errors still show).
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    by_line = {job.line: job for job in jobs}
    rows = [{"line": job.line, "text": lines[job.line - 1]} for job in jobs]
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
            num_gpus=1 if plan.spec.device.startswith("cuda") else None,
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
    from genlib.batch import LineFinish

    if "error" in data:
        return str(data["error"])
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data["finish"].items()}
    return LineFinish(**fields)


def _reason(exc: BaseException) -> str:
    """Why a Ray run failed: genlab's own message where a worker raised one (a model it
    cannot load, say), else the first line of Ray's."""
    cause: BaseException | None = exc
    for _ in range(8):  # Ray's errors wrap the worker's, sometimes a few levels deep
        if cause is None:
            break
        if isinstance(cause, GenlabError):
            return _first_line(Exception(*cause.args))  # not Ray's traceback-laden str()
        cause = getattr(cause, "cause", None) or cause.__cause__
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
