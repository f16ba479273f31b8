"""Generation for a whole JSONL file: parse lines into jobs, group jobs that can share a
forward pass, generate each group in left-padded batches through `genlib.generate.stream`,
and write one result line per input line as soon as it is done.

Input lines are JSON objects: `prompt` (or `messages` for chat models), an optional `id`
(`custom_id` is accepted too, as in the OpenAI batch format) and any generation setting
as a per-line override, `preset` (a preset name) included. Without an id, the 1-based
line number is it. `logprobs` N (0-20, as `--logprobs N`) adds the tokens'
log-probabilities with N alternatives to the line's result, in the OpenAI/vLLM shape
`generate --logprobs` writes.

Results do not depend on how lines are batched: each sampled line draws from its own
generator seeded with `derive_seed(run_seed, id)`, and the decode loop keeps one
generator per row. So a line's output is the same at any batch size and on a resumed
run, which is what makes resuming safe. Each line carries a fingerprint of its prompt and
effective settings (`item_fingerprint`), stored with its result: the results file
(genlib.batch.results, re-exported here) keeps a result only while its line is unchanged.

One line's fault is that line's error record: a line that cannot be parsed, encoded or
generated never stops its batch-mates or the run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genlib import jsonl
from genlib.batch.results import (  # noqa: F401  (the batch-file API, importable from here)
    FINGERPRINT_KEY,
    BatchFileError,
    OutputBusyError,
    Prior,
    ResultsFile,
    ResumePlan,
    StaleResultsError,
    fingerprint,
    id_key,
    plan_resume,
)
from genlib.errors import (
    ChatRenderError,
    ChatTemplateError,
    ConfigError,
    GenlabError,
    PresetError,
    unexpected,
)
from genlib.events import Finish, Token
from genlib.models.memory import check_memory, rows_of
from genlib.settings.config import (
    GenerationSettings,
    closest_key,
    resolve_settings,
    shown,
    validate_settings,
)
from genlib.settings.presets import load_named_preset

if TYPE_CHECKING:
    from genlib.decoding.detail import Detail
    from genlib.models.loading import LoadedModel

ID_KEYS = ("id", "custom_id")
INPUT_KEYS = ("prompt", "messages", "preset", "logprobs", *ID_KEYS)
DEFAULT_SEED = 0  # without --seed, a batch is still reproducible and resumable
MAX_LOGPROBS = 20  # alternatives per token, as --logprobs and OpenAI's top_logprobs


@dataclass(frozen=True)
class LogprobsRequest:
    """A line's `logprobs` as a `LineAdapter` gives it: the tokens' logprobs with `top`
    alternatives, `top` 0 included. OpenAI's chat requests ask for logprobs without
    alternatives (`"logprobs": true`), which genlab's integer cannot say (its 0 is "none",
    as `--logprobs 0`); no JSON line can hold this object, only an adapter."""

    top: int


@dataclass
class Job:
    """One input line, validated: what to generate and with which settings."""

    id: str | int
    line: int
    settings: GenerationSettings
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    ids: list[int] = field(default_factory=list)  # token ids, once encoded
    fingerprint: str = ""
    logprobs: int | None = None  # alternatives per token with logprobs; None: no logprobs


@dataclass(frozen=True)
class LineError:
    """An input line that cannot become a job; it gets an error result."""

    id: str | int
    line: int
    message: str
    fingerprint: str = ""


@dataclass(frozen=True)
class RunDefaults:
    """The run's own settings, under every line: its --preset's and its explicit flags,
    and the model (by `model_identity`), which every line's fingerprint includes."""

    preset_settings: Mapping[str, Any]
    flags: Mapping[str, Any]
    seed: int = DEFAULT_SEED
    chat: bool = False
    system: str | None = None
    model: str = ""
    logprobs: int = 0  # --logprobs N for every line (0: none), under a line's own


def model_identity(ref: str, dtype: str = "auto", quantize: str = "none") -> str:
    """The model as fingerprints name it: a local folder by its absolute real path (so
    `./m` and `/abs/m` agree), a hub id as given; with the dtype and quantization asked
    for when they are not the defaults (they change the logits, so the texts)."""
    path = Path(ref).expanduser()
    name = str(path.resolve()) if path.exists() else ref
    if (dtype, quantize) != ("auto", "none"):
        name += f" (dtype {dtype}, quantize {quantize})"
    return name


# ---------------------------------------------------------------- fingerprints


def job_fingerprint(job: Job, run: RunDefaults) -> str:
    """What a line's output depends on: model, prompt or messages, chat framing and the
    effective settings (the seed only where it is used: sampling), and the logprobs it
    asks for (only when it asks: fingerprints of lines without stay as they were)."""
    settings = job.settings.to_dict()
    del settings["grammar_timeout"]  # how long a compile may take, not what it makes
    for key in ("penalty_alpha", "dola_layers"):  # off: the hash they found stays valid
        if settings[key] is None:
            del settings[key]
    if not job.settings.do_sample:
        settings["seed"] = None
    chat = run.chat or job.messages is not None
    payload = {"model": run.model, "prompt": job.prompt, "messages": job.messages,
               "chat": run.chat, "system": run.system if chat else None,
               "settings": settings}
    if job.logprobs is not None:
        payload["logprobs"] = job.logprobs
    return fingerprint(payload)


def line_error_fingerprint(text: str, run: RunDefaults) -> str:
    """A line that is not a job: its text and the run's settings (a changed flag may
    make it valid)."""
    return fingerprint({"model": run.model, "line": text.strip(),
                        "run": {"preset": dict(run.preset_settings), "flags": dict(run.flags),
                                "seed": run.seed, "chat": run.chat, "system": run.system}})


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
            raise BatchFileError(f"line {number}: id {shown(item.id)} is also the id of line "
                                 f"{seen[key]} (a line without an id has its line number "
                                 f"as id); ids must be unique")
        seen[key] = number
        out.append(item)
    return out


def parse_line(text: str, number: int, run: RunDefaults, adapt: LineAdapter | None = None
               ) -> Job | LineError:
    """One JSONL line -> Job (with its fingerprint), or LineError naming the line number
    and how to fix it. Never raises for what a line holds: a fault no rule foresaw (a
    bug) is that line's error too, in the "unexpected" wording of bugs. `adapt` first
    turns a line of another format into genlab's keys (its id is read before, so an
    error result still carries it)."""
    try:
        item = _parse(text, number, run, adapt)
    except Exception as exc:  # noqa: BLE001  (isolation: one line never stops the file)
        item = LineError(number, number, f"line {number}: {unexpected(exc)}")
    if isinstance(item, Job):
        return dataclasses.replace(item, fingerprint=job_fingerprint(item, run))
    return dataclasses.replace(item, fingerprint=line_error_fingerprint(text, run))


def _parse(text: str, number: int, run: RunDefaults, adapt: LineAdapter | None
           ) -> Job | LineError:
    where = f"line {number}"
    try:
        data = jsonl.loads(text, text_only=False)
    except jsonl.JsonLineError as exc:
        return LineError(number, number, f"{where}: {exc}")
    if not isinstance(data, dict):
        return LineError(number, number, f"{where}: expected a JSON object like "
                                         f'{{"prompt": "..."}}, got {type(data).__name__}')
    try:
        job_id = _line_id(data, number)
        jsonl.check_text(job_id)
    except (ConfigError, jsonl.JsonLineError) as exc:
        message = str(exc)
        return LineError(number, number, message if message.startswith(f"{where}:")
                         else f"{where}: id {message}")
    try:
        jsonl.check_text(data)
    except jsonl.JsonLineError as exc:
        return LineError(job_id, number, f"{where}: {exc}")
    try:
        return _job(data if adapt is None else adapt(data, where), job_id, number, run)
    except GenlabError as exc:  # every message names the line (settings rules do not)
        message = str(exc)
        return LineError(job_id, number, message if message.startswith(f"{where}:")
                         else f"{where}: {message}")
    except Exception as exc:  # noqa: BLE001  (a bug, still the line's error, under its id)
        return LineError(job_id, number, f"{where}: {unexpected(exc)}")


def _line_id(data: Mapping[str, Any], number: int) -> str | int:
    given = [k for k in ID_KEYS if k in data]
    if len(given) > 1:
        raise ConfigError(f"line {number}: give either id or custom_id, not both")
    if not given:
        return number
    value = data[given[0]]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"line {number}: {given[0]} must be a string or an integer, "
                          f"got {shown(value)}")
    return value


def _job(data: Mapping[str, Any], job_id: str | int, number: int, run: RunDefaults) -> Job:
    where = f"line {number}"
    prompt, messages = _prompt_of(data, where)
    overrides = {k: v for k, v in data.items() if k not in INPUT_KEYS}
    validate_settings(overrides, where)
    line_preset: Mapping[str, Any] = {}
    if "preset" in data:
        line_preset = _line_preset(data["preset"], where)
    settings = line_settings(run, line_preset, overrides, job_id, where)
    logprobs = line_logprobs(data, run, where)
    if logprobs is not None and settings.strategy == "beam":
        raise ConfigError(f"{where}: logprobs needs strategy greedy or sample; beam search "
                          f"records no per-token logprobs (drop logprobs from the line, "
                          f"or --logprobs from the command)")
    return Job(id=job_id, line=number, settings=settings, prompt=prompt, messages=messages,
               logprobs=logprobs)


def line_logprobs(data: Mapping[str, Any], run: RunDefaults, where: str) -> int | None:
    """The alternatives per token a line's result lists with its logprobs (None: no
    logprobs): its own `logprobs` (0-20, 0 meaning none, as --logprobs), else the run's."""
    if "logprobs" not in data:
        return run.logprobs or None
    value = data["logprobs"]
    if isinstance(value, LogprobsRequest):
        return value.top
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: logprobs must be an integer (the alternatives per "
                          f"token, 0-{MAX_LOGPROBS}; 0: no logprobs), got {shown(value)}")
    if not 0 <= value <= MAX_LOGPROBS:
        raise ConfigError(f"{where}: logprobs must be 0 <= logprobs <= {MAX_LOGPROBS}, "
                          f"got {shown(value)}")
    return value or None


def _line_preset(name: Any, where: str) -> Mapping[str, Any]:
    """A line's preset, by name only: input lines may come from anyone, so they open no
    file of their choosing, and a message never quotes a preset file's contents."""
    if not isinstance(name, str):
        raise ConfigError(f"{where}: preset must be a preset name (`genlab presets list`), "
                          f"got a {type(name).__name__}")
    try:
        return load_named_preset(name).settings
    except PresetError as exc:
        if exc.quotes_file:  # found, but broken: say which, not what it holds
            raise PresetError(f"preset {name!r} cannot be loaded; `genlab presets show "
                              f"{name}` says why") from None
        raise


def _prompt_of(data: Mapping[str, Any], where: str
               ) -> tuple[str | None, list[dict[str, str]] | None]:
    if "body" in data and "custom_id" in data and "prompt" not in data:
        raise ConfigError(f"{where}: an OpenAI batch request (custom_id, body) where genlab "
                          f"lines are read; a file holds one format, and --format openai "
                          f"reads OpenAI's")
    if ("prompt" in data) == ("messages" in data):
        raise ConfigError(f"{where}: give exactly one of \"prompt\" (text) or \"messages\" "
                          f"(a chat conversation){_misspelled_prompt(data)}")
    if "prompt" in data:
        prompt = data["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{where}: prompt must be a non-empty string, got {shown(prompt)}")
        return prompt, None
    messages = data["messages"]
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), (str, list)) for m in messages)
    if not ok:
        raise ConfigError(f"{where}: messages must be a non-empty list of "
                          f"{{\"role\": ..., \"content\": ...}} objects")
    return None, [{"role": m["role"], "content": _content_text(m["content"], where)}
                  for m in messages]


def _misspelled_prompt(data: Mapping[str, Any]) -> str:
    """' (did you mean 'prompt' for 'promt'?)' where a line has neither and one of its
    keys is near one; else ''."""
    if "prompt" in data or "messages" in data:
        return ""
    for key in data:
        hint = closest_key(key, ("prompt", "messages"))
        if hint:
            return f" (did you mean {hint!r} for {key!r}?)"
    return ""


def _content_text(content: str | list[Any], where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of content parts, whose
    text parts are joined by newlines as vLLM joins them; other parts are refused."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ConfigError(f"{where}: a message's content parts must be text "
                              f"({{\"type\": \"text\", \"text\": ...}}); genlab "
                              f"generates from text only, got {shown(part)}")
        texts.append(part["text"])
    return "\n".join(texts)


def check_one_result(count: Any, where: str, name: str = "num_return_sequences") -> None:
    """Each line gets one result: its num_return_sequences (OpenAI's n) must be 1."""
    if count != 1:
        raise ConfigError(f"{where}: {name} must be 1, as each line gets one result, got "
                          f"{shown(count)}; for more outputs repeat the line with other ids")


def check_line_rerank(settings: GenerationSettings, where: str) -> None:
    """A batch reranks by logprob or mbr: a scoring model would be a model to load that
    a line names (lines never load anything), or one more model in every worker."""
    from genlib.decoding.rerank import METHODS

    if settings.rerank is not None and settings.rerank not in METHODS:
        raise ConfigError(f"{where}: rerank {shown(settings.rerank)} is not logprob or mbr; "
                          f"a batch reranks by those two (a scoring model reranks one-off "
                          f"prompts and the interactive session)")


def line_settings(run: RunDefaults, line_preset: Mapping[str, Any],
                  overrides: Mapping[str, Any], job_id: str | int, where: str
                  ) -> GenerationSettings:
    """Precedence for one line: its own keys > its preset > the run's flags > the run's
    preset > defaults. The seed is the line's own, else derived from the run seed and id."""
    from genlib.settings.config import derive_seed

    under = {**run.preset_settings, **run.flags, **line_preset}
    # Before the settings' own rules (which would suggest sampling for a greedy line).
    check_one_result({**under, **overrides}.get("num_return_sequences", 1), where)
    settings = resolve_settings(overrides, under, source=where,
                                presets=[run.preset_settings, line_preset])
    check_line_rerank(settings, where)
    seed = overrides.get("seed")
    if seed is None:
        seed = derive_seed(run.seed, job_id)
    return dataclasses.replace(settings, seed=seed)


# ---------------------------------------------------------------- grouping


def encode(lm: LoadedModel, job: Job, run: RunDefaults) -> None:
    """Fill `job.ids`; GenlabError (no chat template, too long) fails only this line.
    A prompt that cannot fit however it tokenizes is refused before tokenizing."""
    text = job.prompt if job.messages is None else "".join(m["content"] for m in job.messages)
    lm.check_prompt_chars(text or "", job.settings.max_new_tokens)
    if job.messages is not None:
        try:
            job.ids = lm.encode_chat(job.messages)
        except ChatTemplateError:
            raise ChatTemplateError(f"{lm.ref} has no chat template, so \"messages\" cannot "
                                    f"be used; give the text as \"prompt\" instead") from None
        except ChatRenderError as exc:
            raise ChatRenderError(f"the chat template of {lm.ref} cannot render these "
                                  f"\"messages\" ({exc.reason}); change them (many "
                                  f"templates take no system message), or give the text as "
                                  f"\"prompt\"", exc.reason) from None
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
    """Group jobs by settings (and the logprobs they ask for: one record per batch),
    then cut each group into batches of at most `batch_size` rows of similar prompt
    length (less padding, and rows tend to end together)."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    groups: dict[tuple[GenerationSettings, int | None], list[Job]] = {}
    for job in jobs:
        groups.setdefault((batch_key(job.settings), job.logprobs), []).append(job)
    batches: list[list[Job]] = []
    for members in groups.values():
        ordered = sorted(members, key=lambda j: len(j.ids))
        batches += [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    return batches


# ---------------------------------------------------------------- generating


@dataclass(frozen=True, slots=True)
class LineFinish(Finish):
    """A batch row's Finish with, when its line asked for them, its tokens' logprobs
    object (`genlib.lab.explain.logprobs_content`). Built beside the model, whose tokenizer
    names the tokens, so the Ray engine's workers send it back with the text."""

    logprobs_object: dict[str, Any] | None = None


def result_record(job: Job, finish: Any) -> dict[str, Any]:
    """The output line for a finished job (with `logprobs` where the line asked)."""
    record = {
        "id": job.id,
        "text": finish.text,
        "finish_reason": finish.reason,
        "prompt_tokens": finish.prompt_tokens,
        "new_tokens": finish.new_tokens,
    }
    logprobs = getattr(finish, "logprobs_object", None)
    if logprobs is not None:
        record["logprobs"] = logprobs
    if job.settings.samples is not None:  # sample and rerank: the kept sample's score
        record["score"] = finish.score
    return record | {"settings": job.settings.to_dict(), FINGERPRINT_KEY: job.fingerprint}


def error_record(item: Job | LineError, message: str) -> dict[str, Any]:
    """The output line for a line that failed (resumed runs retry it on request)."""
    return {"id": item.id, "error": message, FINGERPRINT_KEY: item.fingerprint}


def run_batch(lm: LoadedModel, batch: Sequence[Job], backend: str = "auto"
              ) -> Iterator[tuple[Job, Any]]:
    """Generate one batch on the user's `backend`; yield (job, LineFinish) as each row
    ends.

    Rows ended by Ctrl-C (reason "interrupted") are yielded too: the caller must not
    record them as results.
    """
    from genlib.generate import stream

    settings = batch[0].settings
    seeds = [job.settings.seed for job in batch]
    # One record for all rows: plan_batches puts jobs with other logprobs apart.
    detail = logprobs_detail(batch[0].logprobs)
    recorded: dict[int, list[Token]] = {}
    for event in stream(lm, [job.ids for job in batch], settings, seeds=seeds,
                        detail=detail, backend=backend):
        if isinstance(event, Token) and event.detail is not None:
            recorded.setdefault(event.row, []).append(event)
        elif isinstance(event, Finish):
            tokens = recorded.pop(event.row, [])
            yield batch[event.prompt_index], line_finish(
                lm, event, tokens if detail is not None else None)


def logprobs_detail(top: int | None) -> Detail | None:
    """The per-step record a batch's logprobs need (None: none, at no cost)."""
    from genlib.decoding.detail import Detail

    return None if top is None else Detail(logprobs=top)


def line_finish(lm: LoadedModel, finish: Finish, tokens: Sequence[Token] | None
                ) -> LineFinish:
    """`finish` with the logprobs object of its recorded tokens (None: none asked for)."""
    from genlib.lab.explain import logprobs_content

    fields = {f.name: getattr(finish, f.name) for f in dataclasses.fields(Finish)}
    logprobs = logprobs_content(lm, tokens) if tokens is not None else None
    return LineFinish(**fields, logprobs_object=logprobs)


def generate_jobs(lm: LoadedModel, jobs: Sequence[Job], batch_size: int,
                  backend: str = "auto") -> Iterator[tuple[Job, Any]]:
    """Every job's outcome as it ends, on the user's `backend`: (job, Finish), or (job,
    error message) when it cannot be generated. Stops early after rows ended by Ctrl-C
    (reason "interrupted"). TooLargeError, before any batch runs, when one cannot fit in
    memory."""
    batches = plan_batches(jobs, batch_size)
    for batch in batches:
        check_memory(lm, rows_of(len(batch), batch[0].settings),
                     max(len(job.ids) for job in batch) + batch[0].settings.max_new_tokens,
                     remedy="lower --batch-size, or the lines' max_new_tokens")
    for batch in batches:
        interrupted = yield from _isolated(lm, batch, backend)
        if interrupted:
            return


def _isolated(lm: LoadedModel, batch: Sequence[Job], backend: str
              ) -> Iterator[tuple[Job, Any]]:
    """One batch's outcomes. When the batch fails (a row's bad value, out of memory, a
    model error), its unfinished rows run again one by one, so only a row that fails on
    its own gets an error; its batch-mates' texts are the same as batched (seeds are per
    row). Returns whether Ctrl-C ended rows."""
    pending = {id(job): job for job in batch}
    interrupted = False
    try:
        for job, finish in run_batch(lm, batch, backend):
            pending.pop(id(job), None)
            interrupted = interrupted or finish.reason == "interrupted"
            yield job, finish
    except Exception as exc:  # noqa: BLE001  (isolation: a fault is its rows' error)
        if len(batch) > 1 and pending:
            for job in list(pending.values()):
                if (yield from _isolated(lm, [job], backend)):
                    return True
            return False
        for job in pending.values():
            yield job, _failure(exc)
    return interrupted


def _failure(exc: Exception) -> str:
    """A row's error message: a domain error's own, else the wording of a bug."""
    if isinstance(exc, GenlabError):
        return str(exc)
    if isinstance(exc, MemoryError):
        return "out of memory; lower --batch-size, max_new_tokens or num_beams"
    return unexpected(exc)


# ---------------------------------------------------------------- files


def read_input(path: Path) -> list[str]:
    """The input file's lines (`-` reads stdin), split as JSON Lines are: on "\n" only.
    A line that is not UTF-8 comes back marked (jsonl.decode_line) and fails alone."""
    import sys

    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read()
        elif path.is_dir():
            raise BatchFileError(f"--input {path} is a directory; give a JSONL file")
        else:
            data = path.read_bytes()
    except FileNotFoundError:
        raise BatchFileError(f"input file {path} does not exist") from None
    except OSError as exc:
        raise BatchFileError(f"cannot read {path} ({exc.strerror or exc})") from None
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark some editors write
        data = data[3:]
    return [jsonl.decode_line(raw) for raw in jsonl.split_lines(data)]


def same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False
