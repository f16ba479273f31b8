"""OpenAI's Batch format: requests mapped onto genlab's settings (with line numbers on
every error), result lines in the shape vLLM's run-batch and OpenAI's batch API write,
the format detected per file or forced, and resuming a run whose output is in it."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from genlib.batch import jobs as gb
from genlib.batch import openai as ob
from tests.conftest import STORIES
from tests.test_batch import RUN, read_results

MODEL = ["-m", str(STORIES)]
runner = CliRunner()


def request(custom_id: str, url: str = ob.COMPLETIONS, **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "stories", **body}})


def test_requests_map_onto_genlab_settings():
    items = gb.parse_lines([
        request("g", prompt="Once", max_tokens=9, temperature=0, stop="."),
        request("s", prompt="Once", max_completion_tokens=5, temperature=0.7, top_p=0.9,
                seed=3, min_tokens=2),
        request("c", ob.CHAT, messages=[{"role": "user", "content": "hi"}]),
    ], RUN, ob.to_genlab_line)
    g, s, c = items
    assert isinstance(g, gb.Job) and g.id == "g" and g.prompt == "Once"
    assert g.settings.strategy == "greedy" and g.settings.max_new_tokens == 9
    assert g.settings.stop_strings == (".",)
    assert s.settings.strategy == "sample" and s.settings.temperature == 0.7
    assert (s.settings.top_p, s.settings.seed, s.settings.max_new_tokens,
            s.settings.min_new_tokens) == (0.9, 3, 5, 2)
    assert c.messages == [{"role": "user", "content": "hi"}]
    # the seed of a line without one comes from its custom_id, as for a genlab id
    from genlib.settings.config import derive_seed

    assert g.settings.seed == derive_seed(RUN.seed, "g")


def test_bad_requests_fail_their_own_line_with_its_custom_id():
    items = gb.parse_lines([
        request("a", "/v1/embeddings", input="x"),
        request("b", ob.CHAT, prompt="x"),
        request("c", prompt="x", best_of=3),
        request("d", prompt="x", n=2),
        request("e", prompt="x", stream=True),
        json.dumps({"custom_id": "f", "prompt": "x"}),
        json.dumps({"custom_id": "g", "url": ob.COMPLETIONS, "body": {"prompt": "x"},
                    "extra": 1}),
        json.dumps({"custom_id": "h", "body": 5}),
        json.dumps({"custom_id": "i", "url": "/" + "u" * 100_000, "body": {"prompt": "x"}}),
    ], RUN, ob.to_genlab_line)
    errors = {i.id: i.message for i in items}
    assert all(isinstance(i, gb.LineError) for i in items)
    assert errors["a"].startswith("line 1: url '/v1/embeddings' is not supported")
    assert errors["b"] == 'line 2: a /v1/chat/completions request needs "messages" in its body'
    assert errors["c"] == "line 3: genlab does not support best_of 3; remove best_of or set it to 1"
    assert errors["d"] == ("line 4: n must be 1, as each line gets one result, got 2; for "
                           "more outputs repeat the line with other ids")
    assert errors["e"] == "line 5: stream must be false in a batch request"
    assert errors["f"].startswith('line 6: not an OpenAI batch request (no "body")')
    assert errors["g"].startswith("line 7: unknown request field 'extra'")
    assert errors["h"] == "line 8: body must be a JSON object, got int"  # not a TypeError
    assert errors["i"].startswith("line 9: url '/uuu") and len(errors["i"]) < 300


def test_openai_sampling_fields_genlab_has_reach_its_settings():
    """presence_penalty and frequency_penalty mean the same in OpenAI's API and genlab."""
    [job] = gb.parse_lines([request("a", prompt="x", presence_penalty=0.5,
                                    frequency_penalty=0.25, temperature=0.7)],
                           RUN, ob.to_genlab_line)
    assert isinstance(job, gb.Job), job
    s = job.settings
    assert (s.presence_penalty, s.frequency_penalty, s.temperature) == (0.5, 0.25, 0.7)


def test_null_fields_are_not_set_as_in_openai_s_api():
    """`"stop": null` failed the line naming genlab's stop_strings; null is the field's
    default in OpenAI's API (what serialized request objects write)."""
    [job] = gb.parse_lines([request("a", prompt="x", max_tokens=None, stop=None, seed=None,
                                    n=None, temperature=None, top_p=None, logit_bias=None)],
                           RUN, ob.to_genlab_line)
    assert isinstance(job, gb.Job), job
    plain = gb.parse_lines([request("a", prompt="x")], RUN, ob.to_genlab_line)[0]
    assert job.settings == plain.settings and job.fingerprint == plain.fingerprint


def test_vllm_s_top_k_minus_one_is_off():
    """vLLM's request files write top_k -1 for no top-k; it failed the line
    (top_k must be >= 0). -2 is still refused."""
    off, bad = gb.parse_lines([request("a", prompt="x", temperature=0.7, top_k=-1),
                               request("b", prompt="x", temperature=0.7, top_k=-2)],
                              RUN, ob.to_genlab_line)
    assert isinstance(off, gb.Job) and off.settings.top_k == 0, off
    assert "top_k" in bad.message and ">= 0" in bad.message, bad


def test_fields_genlab_lacks_pass_at_values_that_ask_for_nothing():
    """echo false, best_of 1, tools [] ... (what OpenAI's client objects write) failed
    the line as unknown settings, with hints such as "did you mean 'eta_cutoff'?"."""
    quiet = request("a", prompt="x", echo=False, best_of=1, tools=[], tool_choice="none",
                    parallel_tool_calls=True, service_tier="auto")
    items = gb.parse_lines([quiet, request("b", prompt="x", best_of=3),
                            request("c", prompt="x", echo=True),
                            request("d", prompt="x", best_of=True)], RUN, ob.to_genlab_line)
    plain = gb.parse_lines([request("a", prompt="x")], RUN, ob.to_genlab_line)[0]
    assert isinstance(items[0], gb.Job) and items[0].settings == plain.settings, items[0]
    assert [i.message for i in items[1:]] == [
        "line 2: genlab does not support best_of 3; remove best_of or set it to 1",
        "line 3: genlab does not support echo true; remove echo or set it to false",
        "line 4: genlab does not support best_of true; remove best_of or set it to 1"]


def test_two_fields_for_one_setting_fail_the_line():
    """max_tokens with max_completion_tokens (or genlab's max_new_tokens) kept whichever
    came last, silently."""
    items = gb.parse_lines([
        request("a", prompt="x", max_tokens=8, max_completion_tokens=9),
        request("b", prompt="x", max_new_tokens=9, max_tokens=8),
        request("c", prompt="x", response_format={"type": "json_object"},
                json_schema={"type": "object"}),
    ], RUN, ob.to_genlab_line)
    assert [i.message for i in items] == [
        "line 1: max_tokens and max_completion_tokens both set genlab's max_new_tokens; "
        "give one of them",
        "line 2: max_new_tokens and max_tokens both set genlab's max_new_tokens; "
        "give one of them",
        "line 3: response_format and json_schema both set genlab's json_schema; "
        "give one of them"]


def test_a_strategy_in_the_body_wins_over_temperature_whatever_the_order():
    items = gb.parse_lines([request("a", prompt="x", temperature=0.5, strategy="greedy"),
                            request("b", prompt="x", strategy="greedy", temperature=0.5)],
                           RUN, ob.to_genlab_line)
    assert [i.settings.strategy for i in items] == ["greedy", "greedy"]


def test_response_format_is_genlab_s_json_schema():
    """response_format failed its line as an unknown setting ("did you mean
    'presence_penalty'?") though genlab constrains output to a JSON schema."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    items = gb.parse_lines([
        request("s", prompt="x", response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
        request("o", prompt="x", response_format={"type": "json_object"}),
        request("t", prompt="x", response_format={"type": "text"}),
        request("n", prompt="x", response_format={"type": "json_schema",
                                                  "json_schema": {"name": "s"}}),
        request("b", prompt="x", response_format={"type": "yaml"}),
    ], RUN, ob.to_genlab_line)
    s, o, t, n, b = items
    assert json.loads(s.settings.json_schema) == schema
    assert json.loads(o.settings.json_schema) == {"type": "object"}
    assert t.settings.json_schema is None
    assert n.message == ('line 4: a json_schema response_format needs its schema: {"type": '
                         '"json_schema", "json_schema": {"name": ..., "schema": {...}}}')
    assert b.message == ("line 5: response_format must be an object whose type is text, "
                         "json_object or json_schema, got {'type': 'yaml'}")


def test_format_detection():
    assert ob.detect(["", "{oops", request("a", prompt="x")]) == "openai"
    assert ob.detect(['{"id": 1, "prompt": "x"}', request("a", prompt="x")]) == "genlab"
    assert ob.detect([]) == "genlab"


def test_format_detection_passes_over_any_line_it_cannot_read():
    """json.loads raised ValueError (a 5000-digit integer) or RecursionError (deep
    nesting) out of detect, which caught only JSONDecodeError, and the run stopped."""
    for bad in ('{"id": ' + "9" * 5000 + ', "prompt": "x"}', "[" * 100_000,
                '{"a": 1, "a": 2}', '"\\ud800"', "caf\udce9"):
        assert ob.detect([bad, request("a", prompt="x")]) == "openai", bad[:20]
        assert ob.detect([bad, '{"id": 1, "prompt": "x"}']) == "genlab", bad[:20]


def test_an_openai_bad_first_line_fails_alone(tmp_path: Path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("[" * 100_000 + "\n" + request("a", prompt="Once upon a time",
                                                   max_tokens=4) + "\n")
    result = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output",
                                 str(out)])
    assert result.exit_code == 1 and "unexpected" not in result.stderr
    by_custom_id = {line["custom_id"]: line for line in read_results(out)}
    assert by_custom_id["1"]["error"]["message"] == \
        "line 1: not usable JSON: nested too deeply for the parser"
    assert by_custom_id["a"]["response"]["body"]["choices"][0]["text"] == ", there was a"


def test_result_lines_round_trip_and_vllm_lines_read_back():
    record = {"id": 3, "text": "hi", "finish_reason": "eos", "prompt_tokens": 4,
              "new_tokens": 2, "settings": {"seed": 1}}
    line = ob.result_line(record, ob.CHAT, "m")
    assert line["custom_id"] == "3" and line["error"] is None
    body = line["response"]["body"]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["choices"][0]["finish_reason"] == "stop" and body["object"] == "chat.completion"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert ob.record_of(json.loads(json.dumps(line))) == record  # the id keeps its type
    error = ob.result_line({"id": "x", "error": "line 2: bad"}, ob.COMPLETIONS, "m")
    assert error["response"]["status_code"] == 400 and error["error"]["message"] == "line 2: bad"
    assert ob.record_of(error) == {"id": "x", "error": "line 2: bad"}
    vllm = {"id": "vllm-1", "custom_id": "r1", "error": None,
            "response": {"status_code": 200, "request_id": "vllm-batch-1", "body": {
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                             "finish_reason": "stop"}]}}}
    assert ob.record_of(vllm) == {"id": "r1", "text": "ok"}
    assert ob.record_of({"id": "a", "text": "genlab's"}) == {}


def test_grammar_finish_reasons_are_openai_s():
    """grammar_incomplete and schema_invalid were written as OpenAI's finish_reason,
    which is stop or length; genlab's own stays under `genlab`."""
    for reason, openai in (("grammar_incomplete", "length"), ("schema_invalid", "stop")):
        record = {"id": "a", "text": "{", "finish_reason": reason, "prompt_tokens": 2,
                  "new_tokens": 1}
        line = ob.result_line(record, ob.COMPLETIONS, "m")
        assert line["response"]["body"]["choices"][0]["finish_reason"] == openai
        assert line["genlab"]["finish_reason"] == reason


def test_openai_s_error_lines_read_back_as_errors():
    """OpenAI's error file answers a failed request in `body.error`, with `error` null."""
    line = {"id": "batch_req_1", "custom_id": "r1", "error": None,
            "response": {"status_code": 400, "request_id": "req_1",
                         "body": {"error": {"message": "bad model", "type": "x"}}}}
    assert ob.record_of(line) == {"id": "r1", "error": "bad model"}


def test_a_malformed_openai_results_file_is_refused_not_a_crash(tmp_path: Path):
    """An -o file of OpenAI-looking lines of the wrong shapes stopped the run with
    `unexpected AttributeError`/`TypeError` (exit 1)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(request("a", prompt="Once", max_tokens=4) + "\n")
    ok = {"status_code": 200, "body": {"choices": [{"text": "x"}]}}
    for bad in ({"custom_id": "a", "response": 5},
                {"custom_id": "a", "response": {"body": {"choices": [5]}}},
                {"custom_id": "a", "response": {"body": {"choices": 7}}},
                {"custom_id": "a", "response": ok, "genlab": 3}):
        out.write_text(json.dumps(bad) + "\n")
        result = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output",
                                     str(out)])
        assert result.exit_code == 2, (bad, result.output)
        assert result.stderr.strip() == (
            f"error: {out} line 1 is not an OpenAI batch result (one has custom_id and "
            f"response): genlab appends only to its own results files; pick another "
            f"--output (-o) file"), bad
        assert json.loads(out.read_text()) == bad


def test_cli_openai_file_gives_the_genlab_texts_and_resumes(tmp_path: Path):
    prompts = {"a": "Once upon a time", "b": "The little dog", "c": "Lily"}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([*(request(k, prompt=p, max_tokens=8, temperature=0.8)
                                for k, p in prompts.items()),
                              request("chat", ob.CHAT, messages=[{"role": "user",
                                                                  "content": "hi"}])]) + "\n")
    first = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output", str(out)])
    assert first.exit_code == 1, first.output  # stories260K has no chat template
    lines = {x["custom_id"]: x for x in read_results(out)}
    assert set(lines) == {"a", "b", "c", "chat"}
    assert lines["chat"]["response"]["status_code"] == 400
    assert "has no chat template" in lines["chat"]["error"]["message"]

    genlab_src, genlab_out = tmp_path / "g.jsonl", tmp_path / "g_out.jsonl"
    genlab_src.write_text("\n".join(json.dumps({"id": k, "prompt": p, "max_new_tokens": 8,
                                                "temperature": 0.8})
                                    for k, p in prompts.items()) + "\n")
    assert runner.invoke(app, ["generate", *MODEL, "--input", str(genlab_src), "--output",
                               str(genlab_out)]).exit_code == 0
    expected = {r["id"]: r["text"] for r in read_results(genlab_out)}
    assert {k: lines[k]["response"]["body"]["choices"][0]["text"] for k in prompts} == expected

    again = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output", str(out)])
    assert "4 already done (1 of them failed)" in again.stderr
    assert len(read_results(out)) == 4  # nothing doubled

    forced = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output", str(out),
                                 "--format", "genlab"])
    assert forced.exit_code == 2
    assert "already holds results in openai format" in forced.stderr


def test_cli_format_openai_writes_openai_results_for_an_openai_file(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    src.write_text(request("a", prompt="Once upon a time", max_tokens=5) + "\n")
    result = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output", "-",
                                 "--format", "openai"])
    assert result.exit_code == 0, result.output
    (line,) = [json.loads(x) for x in result.stdout.splitlines()]
    assert line["custom_id"] == "a"
    assert line["response"]["body"]["choices"][0]["text"] == ", there was a little"


def test_format_openai_refuses_genlab_lines(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "Once"}\n')
    result = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output", "-",
                                 "--format", "openai"])
    assert result.exit_code == 1
    assert 'line 1: not an OpenAI batch request (no "body")' in result.stderr


# ---------------------------------------------------------------- logprobs


def test_logprobs_fields_of_each_endpoint():
    """Chat asks with logprobs: true and top_logprobs N, completions with logprobs N (0:
    the chosen tokens' alone); explicitly off beats the run's --logprobs; a body that
    names neither takes the run's. Each bad request is its own line's error."""
    run = gb.RunDefaults(preset_settings={}, flags={"max_new_tokens": 16}, seed=7, logprobs=4)
    chat = [{"role": "user", "content": "hi"}]
    items = gb.parse_lines([
        request("chat-top", ob.CHAT, messages=chat, logprobs=True, top_logprobs=3),
        request("chat-bare", ob.CHAT, messages=chat, logprobs=True),
        request("chat-off", ob.CHAT, messages=chat, logprobs=False),
        request("chat-run", ob.CHAT, messages=chat),
        request("cmpl-2", prompt="x", logprobs=2),
        request("cmpl-0", prompt="x", logprobs=0),
        request("cmpl-null", prompt="x", logprobs=None),
        request("chat-top-only", ob.CHAT, messages=chat, top_logprobs=2),
        request("chat-int", ob.CHAT, messages=chat, logprobs=3),
        request("chat-big", ob.CHAT, messages=chat, logprobs=True, top_logprobs=21),
        request("cmpl-top", prompt="x", top_logprobs=2),
        request("cmpl-bool", prompt="x", logprobs=True),
        request("cmpl-big", prompt="x", logprobs=50),
    ], run, ob.to_genlab_line)
    jobs = {i.id: i.logprobs for i in items if isinstance(i, gb.Job)}
    assert jobs == {"chat-top": 3, "chat-bare": 0, "chat-off": None, "chat-run": 4,
                    "cmpl-2": 2, "cmpl-0": 0, "cmpl-null": None}
    errors = {i.id: i.message for i in items if isinstance(i, gb.LineError)}
    assert errors == {
        "chat-top-only": "line 8: top_logprobs needs logprobs: true",
        "chat-int": "line 9: logprobs must be true or false in a /v1/chat/completions "
                    "request (the alternatives are top_logprobs N), got 3",
        "chat-big": "line 10: top_logprobs must be an integer 0-20, got 21",
        "cmpl-top": "line 11: top_logprobs is a /v1/chat/completions field; a "
                    "/v1/completions request gives the alternatives as logprobs N",
        "cmpl-bool": "line 12: logprobs must be an integer 0-20, got True",
        "cmpl-big": "line 13: logprobs must be an integer 0-20, got 50"}


LOGPROBS = {"content": [
    {"token": ",", "id": 432, "bytes": [44], "logprob": -0.03, "processed_logprob": -0.01,
     "rank": 0, "top_logprobs": [
         {"token": ",", "id": 432, "bytes": [44], "logprob": -0.03,
          "processed_logprob": -0.01, "rank": 0},
         {"token": " there", "id": 383, "bytes": [32, 116, 104, 101, 114, 101],
          "logprob": -3.5, "processed_logprob": -4.4, "rank": 1}]},
    {"token": " in", "id": 300, "bytes": [32, 105, 110], "logprob": -2.9,
     "processed_logprob": None, "rank": 1, "top_logprobs": [
         {"token": " there", "id": 383, "bytes": [32, 116, 104, 101, 114, 101],
          "logprob": -0.07, "processed_logprob": -0.03, "rank": 0}]}]}


def test_result_lines_carry_logprobs_as_each_endpoint_does():
    record = {"id": "r", "text": ", in", "finish_reason": "length", "prompt_tokens": 4,
              "new_tokens": 2, "logprobs": LOGPROBS, "settings": {"seed": 1}}
    chat = ob.result_line(record, ob.CHAT, "m")
    assert chat["response"]["body"]["choices"][0]["logprobs"] == LOGPROBS  # OpenAI's keys+
    assert "logprobs" not in chat["genlab"]  # not twice
    assert ob.record_of(json.loads(json.dumps(chat))) == record
    cmpl = ob.result_line(record, ob.COMPLETIONS, "m")
    assert cmpl["response"]["body"]["choices"][0]["logprobs"] == {
        "tokens": [",", " in"], "token_logprobs": [-0.03, -2.9],
        "top_logprobs": [{",": -0.03, " there": -3.5}, {" there": -0.07, " in": -2.9}],
        "text_offset": [0, 1]}
    assert cmpl["genlab"]["logprobs"] == LOGPROBS  # processed logprobs and ids kept
    assert ob.record_of(json.loads(json.dumps(cmpl))) == record
    plain = ob.result_line({k: v for k, v in record.items() if k != "logprobs"}, ob.CHAT, "m")
    assert plain["response"]["body"]["choices"][0]["logprobs"] is None


def test_cli_openai_completions_logprobs_are_generates(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        request("a", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2),
        request("b", prompt="Once upon a time", max_tokens=6, temperature=0,
                top_logprobs=2)]) + "\n")
    result = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output", "-"])
    assert result.exit_code == 1  # line 2's error, and line 1's result
    lines = {x["custom_id"]: x for x in map(json.loads, result.stdout.splitlines())}
    assert lines["b"]["error"]["message"].startswith("line 2: top_logprobs is a")
    got = lines["a"]["response"]["body"]["choices"][0]["logprobs"]
    single = runner.invoke(app, ["generate", "Once upon a time", *MODEL, "-n", "6",
                                 "-s", "greedy", "--logprobs", "2", "--json"])
    expected = json.loads(single.stdout)["outputs"][0]["logprobs"]
    assert lines["a"]["genlab"]["logprobs"] == expected
    assert got["token_logprobs"] == [e["logprob"] for e in expected["content"]]
    assert got["tokens"] == [e["token"] for e in expected["content"]]
    assert [set(top) for top in got["top_logprobs"]] == \
        [{c["token"] for c in e["top_logprobs"]} | {e["token"]} for e in expected["content"]]
    text = lines["a"]["response"]["body"]["choices"][0]["text"]
    assert [text[o:o + len(t)] for o, t in zip(got["text_offset"], got["tokens"])] == \
        got["tokens"]
