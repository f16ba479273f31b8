"""Batch runs under faults: exactly-once output (locks, fingerprints, resume flags),
JSON Lines split on "\\n" only, one poisoned line failing alone, presets from input lines
by name only, special output files, and real processes racing or killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from genlib import jsonl
from genlib.batch import jobs as gb
from genlib.batch import results as br
from genlib.errors import PresetError
from tests.conftest import ROOT, STORIES, wait_for_lines

RUN = gb.RunDefaults(preset_settings={}, flags={"max_new_tokens": 8}, seed=7,
                     model=str(STORIES))
MODEL = ["-m", str(STORIES)]
runner = CliRunner()


def invoke(*args: str, input: str | bytes | None = None):
    return runner.invoke(app, ["generate", *MODEL, *args], input=input)


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in jsonl.split_lines(path.read_bytes())]


def by_id(path: Path) -> dict:
    return {r["id"]: r for r in records_of(path)}


def write_lines(path: Path, *objects: object) -> None:
    path.write_bytes(b"".join((o if isinstance(o, bytes) else
                               (o if isinstance(o, str) else json.dumps(o)).encode()) + b"\n"
                              for o in objects))


# ---------------------------------------------------------------- JSON Lines


def test_lines_split_on_newline_only_and_output_escapes_other_separators(tmp_path: Path):
    text = "a\u2028b\u0085c\u2029d"
    src = tmp_path / "in.jsonl"
    src.write_bytes(json.dumps({"id": "x", "prompt": text}, ensure_ascii=False).encode()
                    + b"\n" + b'{"id": "y", "prompt": "z"}\r\n')
    lines = gb.read_input(src)
    assert len(lines) == 2  # str.splitlines() would make five of them
    jobs = gb.parse_lines(lines, RUN)
    assert [j.prompt for j in jobs] == [text, "z"]
    line = jsonl.dumps({"text": text})
    assert b"\xe2\x80\xa8" not in line and line.decode().count("\n") == 1
    assert line.decode().splitlines() == [line.decode().rstrip("\n")]  # safe for naive readers
    assert json.loads(line) == {"text": text}


def test_a_record_with_a_lone_surrogate_is_still_written_as_valid_utf8():
    line = jsonl.dumps({"id": "\ud800", "text": "é"})
    assert json.loads(line.decode("utf-8")) == {"id": "\ud800", "text": "é"}


# ---------------------------------------------------------------- poisoned lines


def test_each_poisoned_line_fails_alone_with_a_clear_message(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    write_lines(src,
                {"id": "ok1", "prompt": "Once upon a time"},
                '{"id": "sur", "prompt": "a\\ud800b"}',
                '{"id": "\\udc00", "prompt": "x"}',
                '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
                '{"id": "big", "prompt": "x", "seed": 1' + "0" * 5000 + "}",
                b'{"id": "bytes", "prompt": "caf\xe9"}',
                {"id": "seed", "prompt": "x", "seed": 2**64},
                '{"id": "twice", "prompt": "x", "prompt": "y"}',
                {"id": "ok2", "prompt": "Tom and Lily"})
    items = gb.parse_lines(gb.read_input(src), RUN)
    errors = {i.line: i.message for i in items if isinstance(i, gb.LineError)}
    assert [i.id for i in items if isinstance(i, gb.Job)] == ["ok1", "ok2"]
    assert errors[2] == ("line 2: holds a lone surrogate escape (\\ud800), which is not valid "
                         "Unicode text; remove it or escape a complete pair")
    assert errors[3].startswith("line 3: id holds a lone surrogate escape (\\udc00)")
    assert [i.id for i in items if isinstance(i, gb.LineError)][:2] == ["sur", 3]
    assert errors[4] == "line 4: not usable JSON: nested too deeply for the parser"
    assert errors[5] == ("line 5: not usable JSON: an integer of 5,001 digits, more than "
                         "Python reads; no setting takes one, so fix or drop the line")
    assert errors[6] == "line 6: not valid UTF-8 (byte 0xe9 at character 31)"
    assert errors[7] == ("line 7: seed must be 0 <= seed <= 2**64-1 (18446744073709551615), "
                         "got 18446744073709551616")
    assert errors[8] == ('line 8: has the key "prompt" twice in one object; keep one (JSON '
                         'readers differ on which one counts)')
    # Every error record can be written and read back.
    for item in items:
        assert json.loads(jsonl.dumps(gb.error_record(item, "m")))["error"] == "m"


@pytest.mark.parametrize(("first", "message"), [
    ('{"id": ' + "9" * 5000 + ', "prompt": "x"}',
     "line 1: not usable JSON: an integer of 5,000 digits, more than Python reads; no "
     "setting takes one, so fix or drop the line"),
    ("[" * 100_000, "line 1: not usable JSON: nested too deeply for the parser"),
], ids=["long-integer", "deep-nesting"])
def test_a_poisoned_first_line_fails_alone_too(tmp_path: Path, first: str, message: str):
    """Telling the file's format read the first line with json.loads and stopped the run
    on anything but a JSONDecodeError: exit 1, `unexpected ValueError`, nothing written."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, first, {"id": "ok", "prompt": "Once upon a time"})
    result = invoke("--input", str(src), "--output", str(out), "-n", "4")
    assert result.exit_code == 1 and "unexpected" not in result.stderr
    assert "Traceback" not in result.output
    records = by_id(out)
    assert records[1]["error"].startswith(message)
    assert records["ok"]["text"] == ", there was a"
    assert "2 lines · 1 generated · 1 failed" in result.stderr


def test_a_raw_control_character_is_named_once():
    """json's own message ends in "at" ("Invalid control character at"): "at at"."""
    (item,) = gb.parse_lines(['{"id": "c", "prompt": "a\x01b"}'], RUN)
    assert item.message == "line 1: not valid JSON (Invalid control character at column 25)"


def test_a_bias_outside_the_vocabulary_fails_its_line_alone(stories):
    lines = [json.dumps({"id": "ok", "prompt": "Once upon a time", "max_new_tokens": 4}),
             json.dumps({"id": "bad", "prompt": "Once upon a time", "max_new_tokens": 4,
                         "logit_bias": {"99999": 5}})]
    jobs = gb.parse_lines(lines, RUN)
    for job in jobs:
        gb.encode(stories, job, RUN)
    by_id = {job.id: outcome for job, outcome in gb.generate_jobs(stories, jobs, 2)}
    assert by_id["ok"].text == ", there was a"  # 4 tokens
    assert "logit_bias token id 99999 is outside the model's vocabulary (0-511)" in \
        str(by_id["bad"])


def test_a_failing_row_fails_alone_and_its_batch_mates_keep_their_texts(stories, monkeypatch):
    lines = [json.dumps({"id": f"p{i}", "prompt": p, "temperature": 0.8})
             for i, p in enumerate(["Once upon a time", "Tom and Lily", "The cat", "A dog"])]
    jobs = [j for j in gb.parse_lines(lines, RUN)]
    for job in jobs:
        gb.encode(stories, job, RUN)
    alone = {j.id: f.text for j, f in gb.generate_jobs(stories, jobs, 1)}
    real = gb.run_batch

    def poisoned(lm, batch, backend):
        if any(job.id == "p2" for job in batch):
            for job, finish in real(lm, batch, backend):
                if job.id != "p2":
                    yield job, finish  # some rows end before the fault
                    break
            raise RuntimeError("row p2 broke the forward pass")
        yield from real(lm, batch, backend)

    monkeypatch.setattr(gb, "run_batch", poisoned)
    outcomes = {j.id: o for j, o in gb.generate_jobs(stories, jobs, 4)}
    assert outcomes["p2"] == "unexpected RuntimeError: row p2 broke the forward pass"
    assert {k: o.text for k, o in outcomes.items() if k != "p2"} == \
        {k: t for k, t in alone.items() if k != "p2"}


def test_mixed_file_every_good_line_gets_its_text(tmp_path: Path):
    good = [{"id": f"g{i}", "prompt": p} for i, p in
            enumerate(["Once upon a time", "Tom and\u2028Lily", "The cat sat", "A big dog"])]
    src, clean_src = tmp_path / "in.jsonl", tmp_path / "clean.jsonl"
    write_lines(src, good[0], '{"id": "s", "prompt": "\\ud83d"}', good[1],
                b"\xff\xfe\x00garbage", good[2], {"id": "seed", "prompt": "x", "seed": 2**70},
                {"id": "leak", "prompt": "x", "preset": "/etc/passwd"},
                {"id": "huge", "prompt": "Once " * 200_000}, good[3],
                {"id": "beams", "prompt": "x", "num_beams": 300_000})
    write_lines(clean_src, *good)
    out, clean = tmp_path / "out.jsonl", tmp_path / "clean-out.jsonl"
    result = invoke("--input", str(src), "--output", str(out), "-n", "6", "--batch-size", "3")
    assert result.exit_code == 1 and "unexpected" not in result.stderr
    assert invoke("--input", str(clean_src), "--output", str(clean), "-n", "6").exit_code == 0
    records = by_id(out)
    assert len(records_of(out)) == 10
    assert {k: records[k]["text"] for k in ("g0", "g1", "g2", "g3")} == \
        {k: r["text"] for k, r in by_id(clean).items()}
    errors = {k: r["error"] for k, r in records.items() if "error" in r}
    assert set(errors) == {"s", 4, "seed", "leak", "huge", "beams"}
    assert "not valid UTF-8" in errors[4]
    assert "not a path" in errors["leak"] and "root" not in errors["leak"]
    assert "characters) cannot fit in the model's 512 positions" in errors["huge"]
    assert "num_beams must be 1 <= num_beams <= 1024" in errors["beams"]


def test_a_schema_ref_outside_it_or_nested_too_deep_fails_its_line_alone():
    """xgrammar follows only refs inside the schema: one to a file or URL was dropped
    with a warning (the line generated unconstrained); deep nesting took compile time
    and memory growing as its cube, or stopped the line as a bug (RecursionError)."""
    deep = '{"items": ' * 5000 + "{}" + "}" * 5000
    lines = [json.dumps({"id": name, "prompt": "x", "json_schema": schema})
             for name, schema in [
                 ("file", {"$ref": "file:///etc/passwd"}),
                 ("url", {"type": "array", "items": {"$ref": "http://example.com/s.json"}}),
                 ("hidden", {"properties": {"const": {"$dynamicRef": "other.json#a"}}}),
                 ("deep", json.loads('{"items": ' * 70 + "{}" + "}" * 70)),
                 ("deep-text", deep),
                 ("local", {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}),
                 ("data", {"const": {"$ref": "file:///etc/passwd"}})]]
    items = {i.id: i for i in gb.parse_lines(lines, RUN)}
    assert items["file"].message == (
        "line 1: json_schema has $ref 'file:///etc/passwd', outside the schema; only refs "
        'inside it ("#/$defs/NAME") are followed: copy what it names into $defs')
    assert items["url"].message.startswith("line 2: json_schema has $ref 'http://example")
    assert items["hidden"].message.startswith("line 3: json_schema has $dynamicRef 'other")
    for name, number in (("deep", 4), ("deep-text", 5)):
        assert items[name].message == (
            f"line {number}: json_schema is nested deeper than 64 levels; flatten it (name "
            f'its parts in $defs and refer to them with "$ref": "#/$defs/NAME")')
    assert isinstance(items["local"], gb.Job) and isinstance(items["data"], gb.Job)


def test_a_message_quoting_a_line_shows_its_control_characters_escaped(tmp_path: Path):
    """A compile error quotes the line's grammar; written raw, its ESC sequences would
    recolour, retitle or rewrite the user's terminal."""
    pytest.importorskip("xgrammar")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, {"id": "esc", "prompt": "x", "grammar": "root ::= \x1b]0;owned\x07"})
    result = invoke("--input", str(src), "--output", str(out), "-n", "4")
    assert result.exit_code == 1
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert "error: line 1: grammar cannot be compiled: EBNF lexer error at line 1, column " \
           "10: Unexpected character: \\x1b" in result.stderr
    assert by_id(out)["esc"]["error"].endswith("Unexpected character: \x1b")  # as it is


def test_c1_controls_are_escaped_in_results():
    """U+009B is a terminal's CSI, as ESC [ is, for results written to stdout."""
    line = jsonl.dumps({"id": "a\x9b2J", "text": "\x85\x9d"})
    assert line == b'{"id": "a\\u009b2J", "text": "\\u0085\\u009d"}\n'
    assert json.loads(line) == {"id": "a\x9b2J", "text": "\x85\x9d"}


def test_bias_tokens_of_other_digits_are_text_and_a_bug_keeps_the_line_id(monkeypatch):
    """int("²") raises though "²".isdigit(): the line failed as a bug under its line
    number, and "٣" biased the token with id 3."""
    bias = gb.parse_lines([json.dumps({"id": "sup", "prompt": "x", "logit_bias": {"²": 5}}),
                           json.dumps({"id": "ar", "prompt": "x", "logit_bias": {"٣": 1}}),
                           json.dumps({"id": "id", "prompt": "x", "logit_bias": {"12": 2}})],
                          RUN)
    assert [i.settings.logit_bias for i in bias] == [(("²", 5.0),), (("٣", 1.0),), ((12, 2.0),)]

    def bug(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(gb, "line_settings", bug)
    (item,) = gb.parse_lines([json.dumps({"id": "keep", "prompt": "x"})], RUN)
    assert (item.id, item.message) == ("keep", "line 1: unexpected RuntimeError: boom")


# ---------------------------------------------------------------- presets from lines


def test_a_line_preset_is_a_name_never_a_path_and_no_file_content_is_quoted(
        tmp_path: Path, monkeypatch):
    secret = tmp_path / "secret.yaml"
    secret.write_text("AWS_SECRET_KEY_abc123: 1\n")
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "mine.yaml").write_text("SECRET_in_my_preset: 1\n")
    (presets / "fine.yaml").write_text("temperature: 0.3\n")
    monkeypatch.setenv("GENLAB_PRESETS_DIR", str(presets))
    refs = [str(secret), "../secret", "secret.yaml", "~/.ssh/id_rsa", ".hidden", "mine",
            "fine"]
    items = gb.parse_lines([json.dumps({"id": r, "prompt": "x", "preset": r}) for r in refs],
                           RUN)
    messages = {i.id: i.message for i in items if isinstance(i, gb.LineError)}
    for ref in refs[:5]:
        assert "not a path: input lines may not name files" in messages[ref]
    assert messages["mine"] == ("line 6: preset 'mine' cannot be loaded; `genlab presets "
                                "show mine` says why")
    assert all("SECRET" not in m and "abc123" not in m for m in messages.values())
    assert items[-1].settings.temperature == 0.3  # a name in the presets folder works


def test_an_unknown_line_preset_suggests_names_never_a_path(tmp_path: Path, monkeypatch):
    """A line may not name a path, so its message must not suggest one; --preset may."""
    from genlib.settings.presets import load_preset

    monkeypatch.setenv("GENLAB_PRESETS_DIR", str(tmp_path))
    (item,) = gb.parse_lines([json.dumps({"id": "a", "prompt": "x", "preset": "nosuch"})], RUN)
    assert item.message == ("line 1: no preset named 'nosuch'; `genlab presets list` shows "
                            "them")
    (near,) = gb.parse_lines([json.dumps({"prompt": "x", "preset": "creativ"})], RUN)
    assert near.message == ("line 1: no preset named 'creativ' (did you mean 'creative'?); "
                            "`genlab presets list` shows them")
    with pytest.raises(PresetError, match="or pass a path to a .yaml file"):
        load_preset("nosuch")


def test_a_line_preset_name_too_long_for_a_file_is_just_unknown(tmp_path: Path, monkeypatch):
    """Looking it up raised ENAMETOOLONG: `unexpected OSError` naming the presets folder,
    the whole name in the message, and the line number for its id."""
    monkeypatch.setenv("GENLAB_PRESETS_DIR", str(tmp_path))
    (item,) = gb.parse_lines([json.dumps({"id": "a", "prompt": "x", "preset": "p" * 300})],
                             RUN)
    assert item.id == "a"
    assert item.message.startswith("line 1: no preset named 'ppp")
    assert item.message.endswith("'; `genlab presets list` shows them")
    assert str(tmp_path) not in item.message and len(item.message) < 200


def test_yaml_alias_bomb_deep_extends_and_huge_presets_are_refused(tmp_path: Path):
    from genlib.settings.presets import MAX_EXTENDS, load_preset

    bomb = tmp_path / "bomb.yaml"
    rows = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    rows += [f"{c}: &{c} [" + ",".join([f"*{p}"] * 9) + "]"
             for p, c in zip("abcdefgh", "bcdefghi")]
    bomb.write_text("\n".join([*rows, "stop_strings: *i"]) + "\n")
    with pytest.raises(PresetError, match=r"line 2: not valid YAML \(aliases"):
        load_preset(str(bomb))
    for i in range(100):
        (tmp_path / f"p{i}.yaml").write_text(f"extends: p{i + 1}.yaml\n" if i < 99 else "")
    with pytest.raises(PresetError, match=f"extends chain is longer than {MAX_EXTENDS}"):
        load_preset(str(tmp_path / "p0.yaml"))
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20) + "\n")
    with pytest.raises(PresetError, match="larger than a preset may be"):
        load_preset(str(big))


# ---------------------------------------------------------------- fingerprints and plans


def job(**line: object) -> gb.Job:
    (item,) = gb.parse_lines([json.dumps({"id": "a", "prompt": "hi", **line})], RUN)
    assert isinstance(item, gb.Job)
    return item


def test_fingerprint_follows_prompt_settings_model_and_the_seed_only_when_sampling():
    base = job().fingerprint
    assert base.startswith("sha256:") and job().fingerprint == base
    assert job(prompt="hi!").fingerprint != base
    assert job(max_new_tokens=9).fingerprint != base
    assert job(seed=5).fingerprint == base  # greedy: the seed changes nothing
    assert job(temperature=0.7).fingerprint != job(temperature=0.7, seed=5).fingerprint
    other_model = gb.RunDefaults({}, {"max_new_tokens": 8}, 7, model="other")
    assert gb.parse_lines([json.dumps({"id": "a", "prompt": "hi"})],
                          other_model)[0].fingerprint != base


def prior(fp: str | None, failed: bool = False) -> gb.Prior:
    return gb.Prior(fp, failed, 1)


def test_plan_resume_keeps_runs_refuses_and_redoes_as_documented():
    wanted = {'"a"': "f1", '"b"': "f2", '"c"': "f3", '"d"': "f4"}
    old = {'"a"': prior("f1"), '"b"': prior("f2", failed=True), '"d"': prior("f4-old"),
           '"gone"': prior("x")}
    with pytest.raises(gb.StaleResultsError, match=r'1 result\(s\) for ids "d", but their '
                       r"prompt or settings differ .*--redo-changed"):
        gb.plan_resume(wanted, old)
    plan = gb.plan_resume(wanted, old, redo_changed=True)
    assert plan.run == ['"c"', '"d"'] and plan.drop == ['"d"'] and plan.changed == ['"d"']
    assert set(plan.kept) == {'"a"', '"b"'} and plan.failed_before == 1 and plan.orphans == 1
    plan = gb.plan_resume(wanted, {**old, '"d"': prior("f4")}, retry_errors=True)
    assert plan.run == ['"b"', '"c"'] and plan.drop == ['"b"'] and plan.changed == []
    # an error record whose line was fixed runs again without any flag
    plan = gb.plan_resume(wanted, {'"b"': prior("f2-old", failed=True)})
    assert plan.drop == ['"b"'] and '"b"' in plan.run
    with pytest.raises(gb.StaleResultsError, match="written without input fingerprints"):
        gb.plan_resume(wanted, {'"a"': prior(None)})


# ---------------------------------------------------------------- the results file


def test_second_writer_is_refused_and_drop_keeps_the_file_locked(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "1"}\n{"id": "b", "text": "2"}\n'
                   '{"id": "a", "text": "3"}\n{"id": "c", "text": "4"}\n')
    first = gb.ResultsFile.open(out)
    assert first.lock()
    with gb.ResultsFile.open(out) as second, pytest.raises(gb.OutputBusyError,
                                                           match="another genlab run"):
        second.lock()
    assert set(first.read()) == {'"a"', '"b"', '"c"'} and first.duplicates == 1
    assert first.drop(['"b"']) == 2  # b, and the first of the two a's
    assert [r["text"] for r in records_of(out)] == ["3", "4"]
    with gb.ResultsFile.open(out) as third, pytest.raises(gb.OutputBusyError):
        third.lock()  # the renamed file is locked too
    first.append({"id": "d", "text": "5"})
    first.close()
    with gb.ResultsFile.open(out) as fourth:
        assert fourth.lock() and set(fourth.read()) == {'"a"', '"c"', '"d"'}
    assert not list(tmp_path.glob(".*.tmp"))


def test_special_outputs_are_written_not_read(tmp_path: Path):
    with gb.ResultsFile.open(Path("/dev/null")) as devnull:
        assert not devnull.resumable and devnull.read() == {}  # would never end on /dev/zero
        devnull.append({"id": 1, "text": "x"})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    with gb.ResultsFile.open(fifo) as pipe:
        assert pipe.read() == {} and not pipe.lock()
        pipe.append({"id": 1, "text": "x"})
    reader.join(10)
    assert got and json.loads(got[0]) == {"id": 1, "text": "x"}
    with pytest.raises(gb.BatchFileError, match="is a directory"):
        gb.ResultsFile.open(tmp_path)


FOREIGN = 'line {n} is not a genlab result (one has "id" and "text" or "error")'


@pytest.mark.parametrize(("content", "why"), [
    (b'{"id":"x","prompt":"A cat"}\n{"id":"y","prompt":"A dog"}', FOREIGN.format(n=1)),
    (b'{"id":"x","prompt":"A cat"}\n{"id":"y","prompt":"A dog"}\n', FOREIGN.format(n=1)),
    (b"my notes", "line 1 is not valid JSON (Expecting value at column 1)"),
    (b'{"id": "a", "text": "x"}\nmy notes', "line 2 is not valid JSON"),
    (b'{"id": "a", "text": "x"}\n{"id": "y", "prompt": "A do', "line 2 is not valid JSON"),
    (b'{"id": "a", "text": "x"}\n{"id": "b"}', FOREIGN.format(n=2)),
    (b"[" * 100_000, "line 1 is not usable JSON: nested too deeply for the parser"),
], ids=["prompts", "prompts-ended", "notes", "record-then-notes", "record-then-cut-prompt",
        "record-then-id-only", "deep-nesting"])
def test_an_output_file_that_is_not_results_is_refused_untouched(
        tmp_path: Path, content: bytes, why: str):
    """Its last line, whole but without a newline, was cut as "half-written", and the
    results appended after lines that are not results (exit 0)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "other.jsonl"
    write_lines(src, {"id": "a", "prompt": "Once upon a time"})
    out.write_bytes(content)
    result = invoke("--input", str(src), "--output", str(out), "-n", "4")
    assert result.exit_code == 2, result.output
    assert out.read_bytes() == content
    assert result.stderr.startswith(f"error: {out} {why}")
    assert result.stderr.rstrip("\n").endswith(": genlab appends only to its own results "
                                                "files; pick another --output (-o) file")
    assert len(result.stderr.splitlines()) == 1 and "half-written" not in result.stderr


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path: Path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, {"id": "a", "prompt": "Once upon a time"}, {"id": "b", "prompt": "Tom"})
    assert invoke("--input", str(src), "--output", str(out), "-n", "4").exit_code == 0
    done = out.read_bytes()
    out.write_bytes(done.rstrip(b"\n"))  # another tool, or an editor, dropped it
    again = invoke("--input", str(src), "--output", str(out), "-n", "4")
    assert again.exit_code == 0, again.output
    assert "half-written" not in again.stderr and "2 already done" in again.stderr
    assert out.read_bytes() == done


def test_only_a_record_cut_short_is_taken_for_a_half_written_line():
    from genlib.batch.results import half_written

    for cut in (b"{", b'{"id": ', b'{"id": "p1', b'{"id": 12', b'{"id": "a\\"b", "te',
                b'{"id": "p15", "text": "half', b'{"id": 3, "error": "li',
                b'{"id": "genlab-a", "custom_id": "a", "resp'):
        assert half_written(cut), cut
    for other in (b"my notes", b'{"id": "a", "text": "x"}', b'{"id":"y","prompt":"A do',
                  b'{"id": "y", "prompt": "A do', b'{"id": ["x"', b"[[[", b"   "):
        assert not half_written(other), other


# ---------------------------------------------------------------- CLI resume flags


def test_changed_lines_are_refused_then_redone_with_redo_changed(tmp_path: Path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, {"id": "a", "prompt": "Once upon a time"}, {"id": "b", "prompt": "Tom"})
    assert invoke("--input", str(src), "--output", str(out), "-n", "5").exit_code == 0
    before = out.read_bytes()
    write_lines(src, {"id": "a", "prompt": "Once upon a time"}, {"id": "b", "prompt": "Lily"})
    refused = invoke("--input", str(src), "--output", str(out), "-n", "5")
    assert refused.exit_code == 2 and out.read_bytes() == before
    assert 'the results file holds 1 result(s) for ids "b"' in refused.stderr
    assert "--redo-changed" in refused.stderr
    assert invoke("--input", str(src), "--output", str(out), "-n", "6").exit_code == 2
    redone = invoke("--input", str(src), "--output", str(out), "-n", "5", "--redo-changed")
    assert redone.exit_code == 0, redone.stderr
    assert [r["id"] for r in records_of(out)] == ["a", "b"]
    single = runner.invoke(app, ["generate", *MODEL, "-n", "5", "Lily"])
    assert by_id(out)["b"]["text"] == single.stdout.rstrip("\n")


def test_error_lines_are_kept_until_retry_errors(tmp_path: Path, monkeypatch):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, {"id": "a", "prompt": "Once upon a time"}, {"id": "b", "prompt": "Tom"})
    real = gb.run_batch

    def flaky(lm, batch, backend):
        if any(j.id == "b" for j in batch):
            raise MemoryError
        yield from real(lm, batch, backend)

    monkeypatch.setattr(gb, "run_batch", flaky)
    first = invoke("--input", str(src), "--output", str(out), "-n", "5")
    assert first.exit_code == 1
    assert by_id(out)["b"]["error"] == ("line 2: out of memory; lower --batch-size, "
                                        "max_new_tokens or num_beams")
    monkeypatch.setattr(gb, "run_batch", real)
    kept = invoke("--input", str(src), "--output", str(out), "-n", "5")
    assert kept.exit_code == 1 and "--retry-errors runs the failed ones again" in kept.stderr
    retried = invoke("--input", str(src), "--output", str(out), "-n", "5", "--retry-errors")
    assert retried.exit_code == 0, retried.stderr
    assert [r["id"] for r in records_of(out)] == ["a", "b"]
    assert by_id(out)["b"]["text"] and "error" not in by_id(out)["b"]


def test_results_without_fingerprints_are_not_taken_as_done(tmp_path: Path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, {"id": "a", "prompt": "Once upon a time"})
    out.write_text('{"id": "a", "text": "from some other input"}\n')
    refused = invoke("--input", str(src), "--output", str(out), "-n", "5")
    assert refused.exit_code == 2 and "written without input fingerprints" in refused.stderr
    assert invoke("--input", str(src), "--output", str(out), "-n", "5",
                  "--redo-changed").exit_code == 0
    assert [r["text"] for r in records_of(out)] == [", there was a little"]


@pytest.mark.parametrize(("args", "message"), [
    (["--retry-errors", "hi"], "--retry-errors only applies with --input"),
    (["--redo-changed", "-i"], "--redo-changed only applies with --input"),
    (["--redo-changed", "--retry-errors"],
     "--retry-errors, --redo-changed only apply with --input"),
])
def test_resume_flags_need_input(args: list[str], message: str):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr


# ---------------------------------------------------------------- real processes


def batch_command(src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cli", "generate", *MODEL, "--input", str(src),
            "--output", str(out), "-n", "32", "--seed", "3", "--batch-size", "2", *extra]


def long_input(path: Path, n: int = 16, **extra: object) -> None:
    write_lines(path, *({"id": f"p{i}", "prompt": f"Once upon a time {i}",
                         "ignore_eos": True, "temperature": 0.8, **extra} for i in range(n)))


ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_two_processes_racing_on_one_output_write_each_id_once(tmp_path: Path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    long_input(src)
    first = subprocess.Popen(batch_command(src, out), cwd=ROOT, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_lines(out, 1, first, timeout=600)  # a busy machine is slow
    # Frozen mid-run, lock held: the second run meets it however fast this machine is.
    assert first.poll() is None, "the first run ended before the second could race it"
    first.send_signal(signal.SIGSTOP)
    try:
        second = subprocess.run(batch_command(src, out), cwd=ROOT, env=ENV,
                                capture_output=True, text=True, timeout=300)
    finally:
        first.send_signal(signal.SIGCONT)
    _, first_err = first.communicate(timeout=600)
    assert second.returncode == 1
    assert "is being written by another genlab run" in second.stderr
    assert first.returncode == 0, first_err
    ids = [r["id"] for r in records_of(out)]
    assert sorted(ids) == sorted(f"p{i}" for i in range(16))  # each id exactly once


@pytest.mark.slow
def test_sigkill_then_resume_with_a_changed_line(tmp_path: Path):
    src, out, clean = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "clean.jsonl"
    long_input(src, 10)
    proc = subprocess.Popen(batch_command(src, out), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_lines(out, 3, proc, timeout=600)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = [r["id"] for r in records_of(out)]
    assert 3 <= len(done) < 10, "the run should have been killed midway"
    lines = [json.loads(x) for x in jsonl.split_lines(src.read_bytes())]
    changed = next(line for line in lines if line["id"] == done[0])
    changed["prompt"] = "Tom and Lily went to the park"
    write_lines(src, *lines)

    refused = subprocess.run(batch_command(src, out), cwd=ROOT, env=ENV, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2 and "--redo-changed" in refused.stderr
    resumed = subprocess.run(batch_command(src, out, "--redo-changed"), cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    whole = subprocess.run(batch_command(src, clean, "--batch-size", "5"), cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    ids = [r["id"] for r in records_of(out)]
    assert sorted(ids) == sorted(f"p{i}" for i in range(10))
    assert {k: r["text"] for k, r in by_id(out).items()} == \
        {k: r["text"] for k, r in by_id(clean).items()}


# ---------------------------------------------------------------- results file lost


def _tamper_after_first_outcome(monkeypatch, tamper) -> None:
    """Run `tamper()` once the first line's outcome came, before it is written (between
    batches with --batch-size 1), as another process would mid-run."""
    real = gb.generate_jobs

    def hooked(*args, **kwargs):
        for number, outcome in enumerate(real(*args, **kwargs)):
            if number == 1:
                tamper()
            yield outcome

    monkeypatch.setattr(gb, "generate_jobs", hooked)


@pytest.mark.parametrize("how", ["removed", "truncated", "replaced"])
def test_a_results_file_lost_mid_run_exits_1_and_a_rerun_regenerates(
        tmp_path: Path, monkeypatch, how: str):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, *({"id": f"p{i}", "prompt": "Once upon a time"} for i in range(3)))
    tamper = {"removed": out.unlink,
              "truncated": lambda: os.truncate(out, 5),
              "replaced": lambda: (tmp_path / "new").write_text("") or
              os.replace(tmp_path / "new", out)}[how]
    _tamper_after_first_outcome(monkeypatch, tamper)
    result = invoke("--input", str(src), "--output", str(out), "-n", "4", "--batch-size", "1")
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: {out} was "
                                    if how != "truncated" else f"error: {out} changed size")
    assert "results written to it were lost; rerun the same command to generate them " \
           "again" in result.stderr
    assert "generated" not in result.stderr  # no summary claiming the lines are written
    monkeypatch.undo()
    again = invoke("--input", str(src), "--output", str(out), "-n", "4")
    assert again.exit_code == 0, again.output
    assert sorted(r["id"] for r in records_of(out)) == ["p0", "p1", "p2"]


def test_a_results_file_removed_after_the_last_line_is_caught_before_exit(
        tmp_path: Path, monkeypatch):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, {"id": "a", "prompt": "Once upon a time"})
    real = gb.generate_jobs

    def then_remove(*args, **kwargs):
        yield from real(*args, **kwargs)
        out.unlink()

    monkeypatch.setattr(gb, "generate_jobs", then_remove)
    result = invoke("--input", str(src), "--output", str(out), "-n", "4")
    assert result.exit_code == 1, result.output
    assert f"{out} was removed during the run: results written to it were lost" \
        in result.stderr


def test_ctrl_c_between_a_lines_write_and_its_count_keeps_the_run_whole(
        tmp_path: Path, monkeypatch):
    """SIGTERM (as Ctrl-C) landed after a line's bytes were written and before the file's
    count of them grew: the run reported its results file as lost and exited 1, not
    INTERRUPTED with every line it wrote kept."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, *({"id": f"p{i}", "prompt": "Once upon a time"} for i in range(3)))
    real, writes = br._write_all, []

    def write_then_interrupt(fd: int, data: bytes) -> None:
        real(fd, data)
        writes.append(data)
        if len(writes) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(br, "_write_all", write_then_interrupt)
    result = invoke("--input", str(src), "--output", str(out), "-n", "4", "--batch-size", "1")
    assert result.exit_code == 130, result.output
    assert "lost" not in result.stderr
    assert [r["id"] for r in records_of(out)] == ["p0", "p1"]
    monkeypatch.undo()
    again = invoke("--input", str(src), "--output", str(out), "-n", "4")
    assert again.exit_code == 0, again.output
    assert sorted(r["id"] for r in records_of(out)) == ["p0", "p1", "p2"]
