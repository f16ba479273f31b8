"""Generation for a whole JSONL file: parse lines into jobs, group jobs that can share a
forward pass, generate each group in left-padded batches through `genlib.decode.stream`,
and write one result line per input line as soon as it is done.

Input lines are JSON objects: `prompt` (or `messages` for chat models), an optional `id`
(`custom_id` is accepted too, as in the OpenAI batch format) and any generation setting
as a per-line override, `preset` included. Without an id, the 1-based line number is it.

Results do not depend on how lines are batched: each sampled line draws from its own
generator seeded with `derive_seed(run_seed, id)`, and the decode loop keeps one
generator per row. So a line's output is the same at any batch size and on a resumed
run, which is what makes resuming (skip ids already in the output) safe.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from genlib.config import GenerationSettings, resolve_settings, validate_settings
from genlib.errors import ChatTemplateError, ConfigError, GenlabError, UserInputError
from genlib.presets import load_preset

if TYPE_CHECKING:
    from genlib.models import LoadedModel

ID_KEYS = ("id", "custom_id")
INPUT_KEYS = ("prompt", "messages", "preset", *ID_KEYS)
DEFAULT_SEED = 0  # without --seed, a batch is still reproducible and resumable


class BatchFileError(UserInputError):
    """The input or output file of a batch run cannot be used as given."""


@dataclass
class Job:
    """One input line, validated: what to generate and with which settings."""

    id: str | int
    line: int
    settings: GenerationSettings
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    ids: list[int] = field(default_factory=list)  # token ids, once encoded


@dataclass(frozen=True)
class LineError:
    """An input line that cannot become a job; it gets an error result."""

    id: str | int
    line: int
    message: str


@dataclass(frozen=True)
class RunDefaults:
    """The run's own settings, under every line: its --preset's and its explicit flags."""

    preset_settings: Mapping[str, Any]
    flags: Mapping[str, Any]
    seed: int = DEFAULT_SEED
    chat: bool = False
    system: str | None = None


def id_key(value: str | int) -> str:
    """A hashable, type-exact key for an id (1 and "1" are different ids)."""
    return json.dumps(value)


# ---------------------------------------------------------------- parsing


# An input line in another format (e.g. OpenAI's batch format) as a genlab line: the
# parsed object and "line N" -> the same line's genlab keys; raises GenlabError.
LineAdapter = Callable[[Mapping[str, Any], str], Mapping[str, Any]]


def parse_lines(lines: Iterable[str], run: RunDefaults, adapt: LineAdapter | None = None
                ) -> list[Job | LineError]:
    """Every non-blank input line as a Job or a LineError, in input order.

    A repeated id refuses the whole file (BatchFileError): resuming finds done lines by
    id, so two lines with one id would make it skip or double a result.
    """
    seen: dict[str, int] = {}
    out: list[Job | LineError] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        item = parse_line(text, number, run, adapt)
        key = id_key(item.id)
        if key in seen:
            raise BatchFileError(f"line {number}: id {item.id!r} is also the id of line "
                                 f"{seen[key]} (a line without an id has its line number "
                                 f"as id); ids must be unique")
        seen[key] = number
        out.append(item)
    return out


def parse_line(text: str, number: int, run: RunDefaults, adapt: LineAdapter | None = None
               ) -> Job | LineError:
    """One JSONL line -> Job, or LineError naming the line number and how to fix it.
    `adapt` first turns a line of another format into genlab's keys (its id is read
    before, so an error result still carries it)."""
    where = f"line {number}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return LineError(number, number, f"{where}: not valid JSON ({exc.msg} at column "
                                         f"{exc.colno})")
    if not isinstance(data, dict):
        return LineError(number, number, f"{where}: expected a JSON object like "
                                         f'{{"prompt": "..."}}, got {type(data).__name__}')
    try:
        job_id = _line_id(data, number)
    except ConfigError as exc:
        return LineError(number, number, str(exc))
    try:
        return _job(data if adapt is None else adapt(data, where), job_id, number, run)
    except GenlabError as exc:  # every message names the line (settings rules do not)
        message = str(exc)
        return LineError(job_id, number, message if message.startswith(f"{where}:")
                         else f"{where}: {message}")


def _line_id(data: Mapping[str, Any], number: int) -> str | int:
    given = [k for k in ID_KEYS if k in data]
    if len(given) > 1:
        raise ConfigError(f"line {number}: give either id or custom_id, not both")
    if not given:
        return number
    value = data[given[0]]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"line {number}: {given[0]} must be a string or an integer, "
                          f"got {value!r}")
    return value


def _job(data: Mapping[str, Any], job_id: str | int, number: int, run: RunDefaults) -> Job:
    where = f"line {number}"
    prompt, messages = _prompt_of(data, where)
    overrides = {k: v for k, v in data.items() if k not in INPUT_KEYS}
    validate_settings(overrides, where)
    line_preset: Mapping[str, Any] = {}
    if "preset" in data:
        if not isinstance(data["preset"], str):
            raise ConfigError(f"{where}: preset must be a preset name or path, "
                              f"got {data['preset']!r}")
        line_preset = load_preset(data["preset"]).settings
    settings = line_settings(run, line_preset, overrides, job_id, where)
    return Job(id=job_id, line=number, settings=settings, prompt=prompt, messages=messages)


def _prompt_of(data: Mapping[str, Any], where: str
               ) -> tuple[str | None, list[dict[str, str]] | None]:
    if ("prompt" in data) == ("messages" in data):
        raise ConfigError(f"{where}: give exactly one of \"prompt\" (text) or \"messages\" "
                          f"(a chat conversation)")
    if "prompt" in data:
        prompt = data["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{where}: prompt must be a non-empty string, got {prompt!r}")
        return prompt, None
    messages = data["messages"]
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise ConfigError(f"{where}: messages must be a non-empty list of "
                          f"{{\"role\": ..., \"content\": ...}} objects")
    return None, [{"role": m["role"], "content": m["content"]} for m in messages]


def line_settings(run: RunDefaults, line_preset: Mapping[str, Any],
                  overrides: Mapping[str, Any], job_id: str | int, where: str
                  ) -> GenerationSettings:
    """Precedence for one line: its own keys > its preset > the run's flags > the run's
    preset > defaults. The seed is the line's own, else derived from the run seed and id."""
    from genlib.sampling import derive_seed

    under = {**run.preset_settings, **run.flags, **line_preset}
    # Before the settings' own rules (which would suggest sampling for a greedy line).
    if {**under, **overrides}.get("num_return_sequences", 1) != 1:
        raise ConfigError(f"{where}: num_return_sequences must be 1 in batch mode; "
                          f"repeat the line with other ids for more outputs")
    settings = resolve_settings(overrides, under, source=where,
                                presets=[run.preset_settings, line_preset])
    seed = overrides.get("seed")
    if seed is None:
        seed = derive_seed(run.seed, job_id)
    return dataclasses.replace(settings, seed=seed)


# ---------------------------------------------------------------- grouping


def encode(lm: LoadedModel, job: Job, run: RunDefaults) -> None:
    """Fill `job.ids`; GenlabError (no chat template, too long) fails only this line."""
    if job.messages is not None:
        try:
            job.ids = lm.encode_chat(job.messages)
        except ChatTemplateError:
            raise ChatTemplateError(f"{lm.ref} has no chat template, so \"messages\" cannot "
                                    f"be used; give the text as \"prompt\" instead") from None
    elif run.chat:
        system = [{"role": "system", "content": run.system}] if run.system else []
        job.ids = lm.encode_chat([*system, {"role": "user", "content": job.prompt or ""}])
    else:
        job.ids = lm.encode(job.prompt or "")
    lm.check_fits(len(job.ids), job.settings.max_new_tokens)


def batch_key(settings: GenerationSettings) -> GenerationSettings:
    """Jobs whose settings are equal but for the seed can share a forward pass: the
    decode loop takes one seed per row."""
    return dataclasses.replace(settings, seed=None)


def plan_batches(jobs: Sequence[Job], batch_size: int) -> list[list[Job]]:
    """Group jobs by settings, then cut each group into batches of at most `batch_size`
    rows of similar prompt length (less padding, and rows tend to end together)."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    groups: dict[GenerationSettings, list[Job]] = {}
    for job in jobs:
        groups.setdefault(batch_key(job.settings), []).append(job)
    batches: list[list[Job]] = []
    for members in groups.values():
        ordered = sorted(members, key=lambda j: len(j.ids))
        batches += [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    return batches


# ---------------------------------------------------------------- generating


def result_record(job: Job, finish: Any) -> dict[str, Any]:
    """The output line for a finished job."""
    return {
        "id": job.id,
        "text": finish.text,
        "finish_reason": finish.reason,
        "prompt_tokens": finish.prompt_tokens,
        "new_tokens": finish.new_tokens,
        "settings": job.settings.to_dict(),
    }


def error_record(item_id: str | int, message: str) -> dict[str, Any]:
    return {"id": item_id, "error": message}


def run_batch(lm: LoadedModel, batch: Sequence[Job]) -> Iterator[tuple[Job, Any]]:
    """Generate one batch; yield (job, Finish) as each row ends.

    Rows ended by Ctrl-C (reason "interrupted") are yielded too: the caller must not
    record them as results.
    """
    from genlib.decode import stream
    from genlib.events import Finish

    settings = batch[0].settings
    seeds = [job.settings.seed for job in batch]
    for event in stream(lm, [job.ids for job in batch], settings, seeds=seeds):
        if isinstance(event, Finish):
            yield batch[event.prompt_index], event


def generate_jobs(lm: LoadedModel, jobs: Sequence[Job], batch_size: int
                  ) -> Iterator[tuple[Job, Any]]:
    """Every job's outcome as it ends: (job, Finish), or (job, error message) when its
    batch failed. Stops early after rows ended by Ctrl-C (reason "interrupted")."""
    for batch in plan_batches(jobs, batch_size):
        pending = {id(job): job for job in batch}
        interrupted = False
        try:
            for job, finish in run_batch(lm, batch):
                pending.pop(id(job), None)
                interrupted = interrupted or finish.reason == "interrupted"
                yield job, finish
        except (GenlabError, RuntimeError, ValueError) as exc:
            # A failing batch (out of memory, a model error) fails only its own lines.
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                type(exc).__name__
            for job in pending.values():
                yield job, message
            continue
        if interrupted:
            return


# ---------------------------------------------------------------- output file


def scan_output(path: Path, record_of: Callable[[dict[str, Any]], dict[str, Any]] | None
                = None) -> tuple[dict[str, dict[str, Any]], int]:
    """Results already in `path`: {id_key: record}, and how many bytes of a half-written
    last line (left by a crash) were cut off the end of the file to repair it.
    `record_of` reads a line of another format back as genlab's record."""
    if not path.exists():
        return {}, 0
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BatchFileError(f"cannot read {path} to resume ({exc})") from None
    cut = 0
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        cut = len(data) - keep
        with path.open("r+b") as fh:
            fh.truncate(keep)
        data = data[:keep]
    done: dict[str, dict[str, Any]] = {}
    for number, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if record_of is not None and isinstance(record, dict):
                record = record_of(record)
        except json.JSONDecodeError:
            raise BatchFileError(f"{path} line {number} is not valid JSON, so the run "
                                 f"cannot resume from it; fix or move the file") from None
        if not isinstance(record, dict) or "id" not in record:
            raise BatchFileError(f"{path} line {number} is not a genlab result (no id); "
                                 f"give another --output file")
        done[id_key(record["id"])] = record
    return done, cut


class ResultWriter:
    """Appends one JSON line per result and flushes it at once, so a killed run loses
    at most the rows in flight. `on_write` sees every record written; `line_of` turns a
    record into the line written, for another output format (OpenAI's batch format)."""

    def __init__(self, stream: IO[str], on_write: Callable[[dict[str, Any]], None]
                 | None = None, owns: bool = False,
                 line_of: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None):
        self._stream = stream
        self._on_write = on_write
        self._owns = owns  # close the stream at the end (a file, not stdout)
        self._line_of = line_of

    @classmethod
    def open(cls, path: Path, on_write: Callable[[dict[str, Any]], None] | None = None,
             line_of: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
             ) -> ResultWriter:
        try:
            handle = path.open("a", encoding="utf-8")
        except OSError as exc:
            raise BatchFileError(f"cannot write results to {path} ({exc})") from None
        return cls(handle, on_write, owns=True, line_of=line_of)

    def write(self, record: Mapping[str, Any]) -> None:
        line = record if self._line_of is None else self._line_of(record)
        # One write call per line: a crash can only leave the last line half-written,
        # and scan_output repairs that.
        self._stream.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._stream.flush()
        if self._on_write is not None:
            self._on_write(dict(record))

    def close(self) -> None:
        if self._owns:
            self._stream.close()


def read_input(path: Path) -> list[str]:
    """The input file's lines (`-` reads stdin)."""
    import sys

    if str(path) == "-":
        return sys.stdin.read().splitlines()
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise BatchFileError(f"input file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchFileError(f"cannot read {path} ({exc})") from None


def same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
