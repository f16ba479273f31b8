"""OpenAI's Batch format for JSONL batch runs, so files move between genlab, vLLM's
`run-batch` and OpenAI's batch API.

An input line is a request: `custom_id`, `method` ("POST"), `url` ("/v1/completions" with
a `prompt`, or "/v1/chat/completions" with `messages`) and the request `body`, whose
sampling fields are mapped onto genlab's settings (`max_tokens` -> `max_new_tokens`,
`temperature: 0` -> greedy, ...). A result line carries `custom_id`, a `response` with
`status_code` and a completion `body`, and `error` (null, or why the line failed). It also
keeps genlab's own record under the key `genlab` (settings, token counts), which readers
of the format ignore, so a resumed run reads back exactly what it wrote.

Logprobs are asked for as each endpoint asks: chat with `logprobs: true` and
`top_logprobs` N, completions with `logprobs` N; they are answered as each endpoint
answers, in `choices[0].logprobs` (`completion_logprobs` for the completions shape).

genlab's batch code (genlib.batch.jobs) works in its own record shape; this module only
converts at the two edges: `to_genlab_line` for each input line, `result_line` for each
record written, `record_of` for each result read back when resuming.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from genlib import jsonl
from genlib.batch.results import is_record
from genlib.errors import ConfigError
from genlib.settings.config import OTHER_NAMES, shown

FORMATS = ("auto", "genlab", "openai")
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)

# Request fields that do not change the output: which model is genlab's -m, not the file's.
IGNORED = ("model", "user", "metadata", "store", "service_tier")
# OpenAI request fields genlab does not implement, at the values that ask for nothing
# (what serialized request objects write): those pass, any other fails the line.
UNSUPPORTED = {"echo": False, "best_of": 1, "suffix": "", "tools": [], "functions": [],
               "tool_choice": "none", "function_call": "none", "parallel_tool_calls": True}
# genlab's finish reasons as OpenAI's: "stop" (the output ended: an end token, a stop
# string, or genlab.grammar's schema_invalid, an end its JSON schema then failed) or
# "length" (a budget ended it: tokens, time, or genlab.grammar's grammar_incomplete).
FINISH = {"eos": "stop", "stop": "stop", "schema_invalid": "stop", "length": "length",
          "time": "length", "grammar_incomplete": "length"}


def detect(lines: Iterable[str]) -> str:
    """"openai" if the first JSON object line is a batch request (it has a `body`),
    else "genlab". Lines that cannot be read (any fault `jsonl.loads` reports: bad JSON,
    nesting too deep, an integer too long) are passed over: each gets its own error when
    the lines are parsed, as on any other line."""
    for text in lines:
        if not text.strip():
            continue
        try:
            data = jsonl.loads(text, text_only=False)
        except jsonl.JsonLineError:
            continue
        if isinstance(data, dict):
            return "openai" if "body" in data else "genlab"
    return "genlab"


def to_genlab_line(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One OpenAI batch request as a genlab input line (a `genlib.batch.jobs.LineAdapter`)."""
    if "body" not in data:
        raise ConfigError(f'{where}: not an OpenAI batch request (no "body"); a file is '
                          f"in one format, OpenAI's or genlab's")
    unknown = sorted(set(data) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ConfigError(f"{where}: unknown request field {shown(unknown[0])} (a request has "
                          f"custom_id, method, url and body)")
    if "custom_id" not in data:
        raise ConfigError(f"{where}: an OpenAI batch request needs a custom_id")
    if data.get("method", "POST") != "POST":
        raise ConfigError(f"{where}: method must be POST, got {shown(data['method'])}")
    body = data["body"]
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: body must be a JSON object, got {type(body).__name__}")
    url = data.get("url", CHAT if "messages" in body else COMPLETIONS)
    if url not in ENDPOINTS:
        raise ConfigError(f"{where}: url {shown(url)} is not supported; use {COMPLETIONS} "
                          f"(prompt) or {CHAT} (messages)")
    wanted = "messages" if url == CHAT else "prompt"
    if wanted not in body:
        raise ConfigError(f'{where}: a {url} request needs "{wanted}" in its body')
    return {"custom_id": data["custom_id"], **_settings_of(body, where),
            **_logprobs_of(body, url, where)}


def _logprobs_of(body: Mapping[str, Any], url: str, where: str) -> dict[str, Any]:
    """The line's `logprobs` as genlib.batch.jobs takes it, from the request's own fields
    (`_chat_top`, `_completions_top`). A body that names neither: {} (the run's
    --logprobs applies, as to any field the body does not set)."""
    from genlib.batch.jobs import LogprobsRequest

    if "logprobs" not in body and "top_logprobs" not in body:
        return {}
    top = _completions_top(body, where) if url == COMPLETIONS else _chat_top(body, where)
    # None: asked not to (false or null), whatever --logprobs says; genlab's 0 is none
    return {"logprobs": 0 if top is None else LogprobsRequest(top)}


def _chat_top(body: Mapping[str, Any], where: str) -> int | None:
    """Chat's `logprobs` (true, false or null) and `top_logprobs` N (with true; absent:
    0): the alternatives per token, None for no logprobs."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if not (asked is None or isinstance(asked, bool)):
        raise ConfigError(f"{where}: logprobs must be true or false in a {CHAT} request "
                          f"(the alternatives are top_logprobs N), got {shown(asked)}")
    if top is not None and not asked:
        raise ConfigError(f"{where}: top_logprobs needs logprobs: true")
    return _alternatives("top_logprobs", 0 if top is None else top, where) if asked else None


def _completions_top(body: Mapping[str, Any], where: str) -> int | None:
    """Completions' `logprobs` N (null: none; 0: the chosen tokens' alone)."""
    if "top_logprobs" in body:
        raise ConfigError(f"{where}: top_logprobs is a {CHAT} field; a {COMPLETIONS} "
                          f"request gives the alternatives as logprobs N")
    value = body["logprobs"]
    return None if value is None else _alternatives("logprobs", value, where)


def _alternatives(name: str, value: Any, where: str) -> int:
    from genlib.batch.jobs import MAX_LOGPROBS

    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise ConfigError(f"{where}: {name} must be an integer 0-{MAX_LOGPROBS}, "
                          f"got {shown(value)}")
    return value


def _settings_of(body: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The body's fields as genlab settings. A field set to null is not set (OpenAI's
    null is the field's default); two fields that set one genlab setting
    (`max_tokens` and `max_completion_tokens`, ...) fail the line, not one of them."""
    out: dict[str, Any] = {}
    field_of: dict[str, str] = {}  # genlab setting -> the field that set it
    for key, value in body.items():
        if key in IGNORED or key in ("logprobs", "top_logprobs") or value is None:
            continue  # logprobs: see _logprobs_of
        for name, setting in _field_settings(key, value, where):
            if key == "temperature" and name == "strategy":
                out.setdefault(name, setting)  # a strategy the body gives wins
                continue
            if name in field_of:
                raise ConfigError(f"{where}: {field_of[name]} and {key} both set genlab's "
                                  f"{name}; give one of them")
            field_of[name] = key
            out[name] = setting
    return out


def _field_settings(key: str, value: Any, where: str) -> list[tuple[str, Any]]:
    """One body field as the genlab settings it sets (none, one, or temperature's two);
    a name genlab does not know passes on, for genlab's own checks to name."""
    from genlib.batch.jobs import check_one_result

    if key == "stream":
        if value:
            raise ConfigError(f"{where}: stream must be false in a batch request")
        return []
    if key in UNSUPPORTED:
        _check_unsupported(key, value, where)
        return []
    if key == "n":
        check_one_result(value, where, "n")
    if key == "response_format":
        schema = _response_schema(value, where)
        return [] if schema is None else [("json_schema", schema)]
    if key == "temperature":
        # OpenAI samples at any temperature above 0; 0 means the most likely token.
        zero = isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
        return [("strategy", "greedy")] if zero else [("strategy", "sample"), (key, value)]
    if key == "stop" and isinstance(value, str):
        value = [value]
    if key == "top_k" and value == -1 and not isinstance(value, bool):
        value = 0  # vLLM's "off" (-1) is genlab's and transformers' 0
    return [(OTHER_NAMES.get(key, key), value)]


def _check_unsupported(key: str, value: Any, where: str) -> None:
    """A field genlab lacks passes only at the value that asks for nothing."""
    wanted = UNSUPPORTED[key]
    if value != wanted or isinstance(value, bool) != isinstance(wanted, bool):
        raise ConfigError(f"{where}: genlab does not support {key} {jsonl.excerpt(value, 60)}; "
                          f"remove {key} or set it to {json.dumps(wanted)}")


def _response_schema(value: Any, where: str) -> dict[str, Any] | None:
    """response_format as genlab's json_schema: `json_schema`'s own schema,
    `json_object` (JSON mode) any JSON object, `text` none."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ConfigError(f"{where}: response_format must be an object whose type is "
                          f"text, json_object or json_schema, got {shown(value)}")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ConfigError(f"{where}: a json_schema response_format needs its schema: "
                          f'{{"type": "json_schema", "json_schema": {{"name": ..., '
                          f'"schema": {{...}}}}}}')
    return schema


def result_line(record: Mapping[str, Any], endpoint: str, model: str) -> dict[str, Any]:
    """genlab's result (or error) record as an OpenAI batch result line. Its `logprobs`
    go to `choices[0].logprobs`: for chat as they are (OpenAI's shape, plus genlab's
    `id`, `processed_logprob` and `rank`), so `genlab` does not repeat them; for
    completions in that endpoint's own shape, so `genlab` keeps the whole object."""
    custom_id = str(record["id"])
    logprobs = record.get("logprobs")
    extra = {k: v for k, v in record.items()
             if k != "text" and not (k == "logprobs" and endpoint == CHAT)}
    if "error" in record:
        return {"id": f"genlab-{custom_id}", "custom_id": custom_id,
                "response": {"status_code": 400, "request_id": f"genlab-batch-{custom_id}",
                             "body": None},
                "error": {"code": "invalid_request", "message": record["error"]},
                "genlab": extra}
    reason = FINISH.get(record["finish_reason"], record["finish_reason"])
    if endpoint == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": record["text"]},
                  "logprobs": logprobs, "finish_reason": reason}
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": record["text"],
                  "logprobs": None if logprobs is None else completion_logprobs(logprobs),
                  "finish_reason": reason}
        kind, prefix = "text_completion", "cmpl"
    usage = {"prompt_tokens": record["prompt_tokens"], "completion_tokens": record["new_tokens"],
             "total_tokens": record["prompt_tokens"] + record["new_tokens"]}
    body = {"id": f"{prefix}-{custom_id}", "object": kind, "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage}
    return {"id": f"genlab-{custom_id}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": f"genlab-batch-{custom_id}",
                         "body": body},
            "error": None, "genlab": extra}


def completion_logprobs(logprobs: Mapping[str, Any]) -> dict[str, Any]:
    """genlab's logprobs object in the shape of `/v1/completions`: parallel lists of the
    tokens, their logprobs, each step's top alternatives as {token: logprob} with the
    chosen token among them (so up to N + 1 entries, as OpenAI's), and each token's
    character offset in the completion text (as vLLM's)."""
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
    for entry in logprobs["content"]:
        tokens.append(entry["token"])
        values.append(entry["logprob"])
        offsets.append(offset)
        offset += len(entry["token"])
        top = {c["token"]: c["logprob"] for c in entry["top_logprobs"]}
        top.setdefault(entry["token"], entry["logprob"])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def record_of(line: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI batch result line (genlab's, vLLM's or OpenAI's) read back as genlab's
    record; {} for a line that is not one (the caller refuses it). A failed request is
    one with an `error`, or a response without a body or with its own `body.error`
    (OpenAI's error file)."""
    response, extra = line.get("response"), line.get("genlab", {})
    if "custom_id" not in line or "response" not in line or \
            not isinstance(response or {}, dict) or not isinstance(extra, dict):
        return {}
    record: dict[str, Any] = {"id": line["custom_id"], **extra}
    body = (response or {}).get("body")
    error = line.get("error")
    if error is None and isinstance(body, dict):
        error = body.get("error")
    if error is not None or not body:
        message = error.get("message") if isinstance(error, dict) else error
        record["error"] = str(message or "the request failed")
        return record
    choices = body.get("choices") if isinstance(body, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        return {}
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    if not isinstance(text, str):
        return {}
    record["text"] = text
    logprobs = choice.get("logprobs")
    if "genlab" in line and "message" in choice and isinstance(logprobs, dict):
        record["logprobs"] = logprobs  # a chat answer's, which `genlab` does not repeat
    return record


def endpoint_for(has_messages: bool, chat: bool) -> str:
    """The endpoint a line's result answers: chat for `messages` or a --chat run."""
    return CHAT if has_messages or chat else COMPLETIONS


def results_format(path: Path) -> str | None:
    """The format of the results already in `path` ("openai" or "genlab"), None when it
    holds none yet (or is not a regular file: a pipe is never read). Only the first line
    is read: a file is in one format."""
    if not path.is_file():
        return None
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            first = next((text for text in fh if text.strip()), "")
    except OSError:
        return None
    try:
        data = jsonl.loads(first, text_only=False)
    except jsonl.JsonLineError:
        return None  # half-written, or not results: ResultsFile.read repairs or refuses
    if isinstance(data, dict) and "custom_id" in data and "response" in data:
        return "openai"
    # Not a genlab record either: no format to keep; ResultsFile.read refuses it.
    return "genlab" if is_record(data) else None


def line_writer(endpoints: Mapping[str, str], model: str
                ) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """`genlib.batch.results.ResultsFile.in_format`'s `line_of` for OpenAI output:
    `endpoints` maps each id's `id_key` to the endpoint its request named."""
    from genlib.batch.jobs import id_key

    def line_of(record: Mapping[str, Any]) -> dict[str, Any]:
        return result_line(record, endpoints.get(id_key(record["id"]), COMPLETIONS), model)

    return line_of
