"""JSONL batch generation: parsing and validation with line numbers, per-line settings
and seeds, grouping, batch-size invariance, resume (with repair), and the CLI run,
including a real subprocess killed with SIGKILL mid-run and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from genlib.batch import jobs as gb
from genlib.errors import ChatRenderError, ChatTemplateError
from genlib.settings.config import derive_seed
from tests.conftest import ROOT, STORIES, wait_for_lines

RUN = gb.RunDefaults(preset_settings={}, flags={"max_new_tokens": 16}, seed=7)
MODEL = ["-m", str(STORIES)]
WORDS = "Once upon a time there was a little girl named Lily who loved to play in the park".split()


def lines_of(*objects: object) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objects]


def mixed_prompts(n: int, **extra: object) -> list[str]:
    """n lines of different lengths; every other line sampled at temperature 0.8."""
    out = []
    for i in range(n):
        line: dict[str, object] = {"id": f"p{i}", "prompt": " ".join(WORDS[:4 + (i * 7) % 13])}
        if i % 2:
            line["temperature"] = 0.8
        out.append(json.dumps({**line, **extra}))
    return out


# ---------------------------------------------------------------- parsing


def test_bad_lines_are_reported_with_their_line_number():
    items = gb.parse_lines(lines_of(
        {"prompt": "ok"},
        "{not json",
        "",  # blank lines are skipped, numbering still counts them
        [1, 2],
        {"id": "x"},
        {"id": "y", "prompt": "a", "temprature": 0.5},
        {"id": "z", "prompt": "a", "top_p": 2},
        {"id": 1.5, "prompt": "a"},
        {"id": "w", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"id": "v", "prompt": "a", "num_return_sequences": 2},
        {"id": "u", "prompt": "a", "min_new_tokens": 50, "max_new_tokens": 5},
        {"id": "t", "prompt": "a", "preset": "no-such-preset"},
    ), RUN)
    errors = {i.line: i.message for i in items if isinstance(i, gb.LineError)}
    assert isinstance(items[0], gb.Job) and items[0].id == 1
    assert errors[2].startswith("line 2: not valid JSON")
    assert errors[4] == 'line 4: expected a JSON object like {"prompt": "..."}, got list'
    assert errors[5].startswith('line 5: give exactly one of "prompt"')
    assert errors[6] == ("line 6: unknown setting 'temprature' (did you mean 'temperature'?); "
                         "`genlab presets keys` lists them all")
    assert errors[7] == "line 7: top_p must be 0 < top_p <= 1, got 2.0"
    assert errors[8] == "line 8: id must be a string or an integer, got 1.5"
    assert errors[9].startswith('line 9: give exactly one of "prompt"')
    # the batch rule comes first (not the greedy rule's advice to sample, which it refuses)
    assert errors[10] == ("line 10: num_return_sequences must be 1, as each line gets one "
                          "result, got 2; for more outputs repeat the line with other ids")
    assert errors[11] == "line 11: min_new_tokens (50) must be <= max_new_tokens (5)"
    assert errors[12].startswith("line 12: ") and "no-such-preset" in errors[12]
    assert [i.id for i in items if isinstance(i, gb.LineError)] == \
        [2, 4, "x", "y", "z", 8, "w", "v", "u", "t"]


def test_a_misspelled_prompt_key_is_named_with_the_key_it_is_near():
    items = gb.parse_lines(lines_of({"promt": "Once"}, {"mesages": []}, {"id": 3},
                                    {"prompt": "a", "messages": []}), RUN)
    errors = [i.message for i in items]
    need = 'give exactly one of "prompt" (text) or "messages" (a chat conversation)'
    assert errors == [f"line 1: {need} (did you mean 'prompt' for 'promt'?)",
                      f"line 2: {need} (did you mean 'messages' for 'mesages'?)",
                      f"line 3: {need}", f"line 4: {need}"]


def test_openai_names_of_settings_point_to_genlab_s():
    """`stop` was refused with "did you mean 'top_p'?" (the closest spelling), while the
    docs listed it as a line key; the setting is stop_strings."""
    items = gb.parse_lines(lines_of(
        {"id": "s", "prompt": "a", "stop": ["."]},
        {"id": "m", "prompt": "a", "max_tokens": 4},
        {"id": "t", "prompt": "a", "temprature": 0.5, "stop": ["."]},  # the first one counts
        {"id": "ok", "prompt": "a", "stop_strings": ["."], "max_new_tokens": 4},
    ), RUN)
    hint = "; `genlab presets keys` lists them all"
    assert [i.message for i in items[:3]] == [
        f"line 1: unknown setting 'stop' (did you mean 'stop_strings'?){hint}",
        f"line 2: unknown setting 'max_tokens' (did you mean 'max_new_tokens'?){hint}",
        f"line 3: unknown setting 'temprature' (did you mean 'temperature'?){hint}"]
    assert items[3].settings.stop_strings == (".",) and items[3].settings.max_new_tokens == 4


def test_the_line_keys_batch_md_names_are_settings():
    """Every setting docs/batch.md gives as an example of a line key is accepted."""
    import re

    from genlib.settings.config import SPECS

    row = next(line for line in (ROOT / "docs" / "batch.md").read_text().splitlines()
               if line.startswith("| any generation setting |"))
    examples = re.search(r"`GenerationConfig` \(([^;]*);", row).group(1)
    named = re.findall(r"`(\w+)`", examples)
    assert "stop_strings" in named and all(key in SPECS for key in named), named


def test_duplicate_ids_refuse_the_file():
    with pytest.raises(gb.BatchFileError, match="line 3: id 1 is also the id of line 1"):
        gb.parse_lines(lines_of({"prompt": "a"}, {"id": "b", "prompt": "b"},
                                {"id": 1, "prompt": "c"}), RUN)


def test_line_settings_win_over_run_settings_and_seeds_derive_from_the_id():
    run = gb.RunDefaults(preset_settings={"temperature": 0.5, "top_p": 0.9},
                         flags={"max_new_tokens": 16}, seed=7)
    first, second, third = gb.parse_lines(lines_of(
        {"custom_id": "a", "prompt": "x"},
        {"id": "b", "prompt": "x", "temperature": 1.2, "max_new_tokens": 4},
        {"id": "c", "prompt": "x", "preset": "greedy", "seed": 99},
    ), run)
    assert first.id == "a" and first.settings.temperature == 0.5
    assert first.settings.top_p == 0.9 and first.settings.max_new_tokens == 16
    assert first.settings.seed == derive_seed(7, "a")
    assert second.settings.temperature == 1.2 and second.settings.max_new_tokens == 4
    assert second.settings.seed == derive_seed(7, "b")
    assert third.settings.seed == 99  # a line's own seed is used as given


def test_beams_over_a_sampling_preset_sample_as_in_single_prompt_mode():
    creative = {"strategy": "sample", "temperature": 0.9, "top_p": 0.92}
    beams = gb.line_settings(gb.RunDefaults(creative, {"strategy": "beam"}, seed=1), {}, {},
                             "a", "line 1")
    assert beams.strategy == "beam" and beams.do_sample  # -p creative -s beam
    # sampling flags on the command line are not a preset: a beam line stays plain beams
    flags = gb.line_settings(gb.RunDefaults({}, {"temperature": 0.7}, seed=1), {},
                             {"strategy": "beam"}, "b", "line 2")
    assert flags.strategy == "beam" and not flags.do_sample
    # a line's own sampling preset counts too
    line = gb.line_settings(gb.RunDefaults({}, {}, seed=1), creative, {"strategy": "beam"},
                            "c", "line 3")
    assert line.do_sample


def test_grouping_keeps_settings_apart_and_respects_the_batch_size(stories):
    items = gb.parse_lines(lines_of(*mixed_prompts(7)), RUN)
    for job in items:
        gb.encode(stories, job, RUN)
    batches = gb.plan_batches(items, 2)
    assert sorted(j.id for b in batches for j in b) == sorted(j.id for j in items)
    for batch in batches:
        assert 1 <= len(batch) <= 2
        assert len({gb.batch_key(j.settings) for j in batch}) == 1
    assert len(gb.plan_batches(items, 32)) == 2  # greedy lines and sampled lines


def test_messages_need_a_chat_template(stories):
    (job,) = gb.parse_lines(lines_of({"messages": [{"role": "user", "content": "hi"}]}), RUN)
    with pytest.raises(ChatTemplateError, match='"messages" cannot be used'):
        gb.encode(stories, job, RUN)


def test_content_parts_are_text_joined_as_vllm_joins_them():
    """OpenAI's content as a list of parts was refused as not {role, content}."""
    parts = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Hi"}]
    joined, image, bare = gb.parse_lines(lines_of(
        {"messages": [{"role": "user", "content": parts}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]}), RUN)
    assert joined.messages == [{"role": "user", "content": "Be brief.\nHi"}]
    assert image.message.startswith("line 2: a message's content parts must be text")
    assert image.message.endswith("got {'image_url': {}, 'type': 'image_url'}")
    assert bare.message.startswith("line 3: a message's content parts must be text")


def test_an_openai_request_read_as_a_genlab_line_names_the_format():
    """--format genlab on an OpenAI file said "give exactly one of prompt or messages"."""
    request = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "x"}}
    (item,) = gb.parse_lines(lines_of(request), RUN)
    assert item.message == ("line 1: an OpenAI batch request (custom_id, body) where genlab "
                            "lines are read; a file holds one format, and --format openai "
                            "reads OpenAI's")


def test_a_template_refusing_a_line_s_messages_names_the_line_s_fix(stories):
    """A "messages" line with a system message, on a template that refuses system roles,
    was told to "drop the system message (--system)", a flag the run never had."""
    refusing = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}"
                "{{ m['content'] }}{% endfor %}")
    (job,) = gb.parse_lines(lines_of({"messages": [{"role": "system", "content": "Be kind."},
                                                   {"role": "user", "content": "Hi"}]}), RUN)
    stories.tokenizer.chat_template = refusing
    try:
        with pytest.raises(ChatRenderError) as refused:
            gb.encode(stories, job, RUN)
    finally:
        stories.tokenizer.chat_template = None
    assert str(refused.value) == (
        f'the chat template of {stories.ref} cannot render these "messages" (System role not '
        f'supported); change them (many templates take no system message), or give the '
        f'text as "prompt"')


# ---------------------------------------------------------------- generation


def generate_texts(lm, lines: list[str], batch_size: int) -> dict[object, str]:
    jobs = gb.parse_lines(lines, RUN)
    for job in jobs:
        gb.encode(lm, job, RUN)
    return {job.id: finish.text for job, finish in gb.generate_jobs(lm, jobs, batch_size)}


def test_outputs_do_not_depend_on_the_batch_size(stories):
    lines = mixed_prompts(8)
    one = generate_texts(stories, lines, 1)
    assert one["p0"] == ", there was a little girl named Lily. She loved to play"  # golden
    assert generate_texts(stories, lines, 3) == one
    assert generate_texts(stories, lines, 8) == one
    # and on a "resumed" run that only has some of the lines
    assert generate_texts(stories, lines[3:], 4) == {k: one[k] for k in one if k not in
                                                     ("p0", "p1", "p2")}
    assert len(set(one.values())) == 8  # the sampled lines really differ from each other


def test_beam_lines_run_beam_search_at_any_batch_size(stories):
    from genlib.decoding.beam import beam_search
    from genlib.settings.config import resolve_settings
    from genlib.settings.presets import load_preset

    prompts = {"a": "Once upon a time", "b": "The little dog ran to the", "c": "Lily"}
    lines = lines_of(*({"id": k, "prompt": p, "preset": "beam", "max_new_tokens": 16}
                       for k, p in prompts.items()))
    one = generate_texts(stories, lines, 1)
    assert generate_texts(stories, lines, 3) == one
    settings = resolve_settings({"max_new_tokens": 16}, load_preset("beam").settings)
    for key, prompt in prompts.items():
        [best] = beam_search(stories, [stories.encode(prompt)], settings)
        assert one[key] == best.hypotheses[0].text


def test_another_run_seed_changes_sampled_lines_only(stories):
    lines = mixed_prompts(4)
    base = generate_texts(stories, lines, 4)
    jobs = gb.parse_lines(lines, gb.RunDefaults({}, {"max_new_tokens": 16}, seed=8))
    for job in jobs:
        gb.encode(stories, job, RUN)
    other = {j.id: f.text for j, f in gb.generate_jobs(stories, jobs, 4)}
    assert other["p0"] == base["p0"] and other["p2"] == base["p2"]  # greedy
    assert other["p1"] != base["p1"] or other["p3"] != base["p3"]  # sampled


# ---------------------------------------------------------------- output file


def scan_output(path: Path) -> tuple[dict, int]:
    with gb.ResultsFile.open(path) as results:
        return results.read(), results.repaired_bytes


def test_scan_output_repairs_a_half_written_last_line(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "x"}\n{"id": 2, "error": "bad"}\n{"id": "c", "te')
    done, cut = scan_output(out)
    assert set(done) == {gb.id_key("a"), gb.id_key(2)} and cut == len('{"id": "c", "te')
    assert out.read_text().endswith('"bad"}\n')
    assert scan_output(out) == (done, 0)


def test_scan_output_refuses_a_file_that_is_not_results(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "x"}\nnot json\n{"id": "b", "text": "y"}\n')
    with pytest.raises(gb.BatchFileError, match="line 2 is not valid JSON"):
        scan_output(out)


# ---------------------------------------------------------------- CLI

runner = CliRunner()


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, ["generate", *MODEL, *args], input=input)


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_writes_one_line_per_input_line_and_resumes(tmp_path: Path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([*mixed_prompts(3), '{"id": "bad", "prompt": "x", "top_k": -1}',
                              "{oops"]) + "\n")
    first = invoke("--input", str(src), "--output", str(out), "-n", "8", "--batch-size", "2")
    assert first.exit_code == 1  # two lines failed
    records = {r["id"]: r for r in read_results(out)}
    assert set(records) == {"p0", "p1", "p2", "bad", 5}
    assert records["bad"].pop("fingerprint").startswith("sha256:")
    assert records["bad"] == {"id": "bad", "error": "line 4: top_k must be >= 0, got -1"}
    assert records[5]["error"].startswith("line 5: not valid JSON")
    assert records["p0"]["text"] == ", there was a little girl"
    assert records["p0"]["new_tokens"] == 8 and records["p0"]["finish_reason"] == "length"
    assert records["p1"]["settings"]["temperature"] == 0.8
    assert "line 4: top_k must be >= 0" in first.stderr
    assert "5 lines · 3 generated · 2 failed" in first.stderr

    second = invoke("--input", str(src), "--output", str(out), "-n", "8")
    assert second.exit_code == 1  # earlier failures still count
    assert len(read_results(out)) == 5  # nothing doubled
    assert "5 already done (2 of them failed)" in second.stderr


def test_cli_output_dash_writes_jsonl_to_stdout(tmp_path: Path):
    result = invoke("--input", "-", "--output", "-", "-n", "5",
                    input='{"prompt": "Once upon a time"}\n')
    assert result.exit_code == 0, result.output
    (record,) = [json.loads(x) for x in result.stdout.splitlines()]
    assert record["id"] == 1 and record["text"] == ", there was a little"


@pytest.mark.parametrize("text", ["", "\n\n"], ids=["empty", "blank lines"])
def test_an_input_with_no_lines_says_so_and_writes_an_empty_file(tmp_path: Path, text: str):
    out = tmp_path / "out.jsonl"
    result = invoke("--input", "-", "--output", str(out), input=text)
    assert result.exit_code == 0, result.output  # an empty batch is done, as `jq` is
    assert result.stderr.splitlines()[0] == "warning: stdin has no lines to run: nothing " \
        "to generate"
    assert "0 lines · 0 generated · 0 failed" in result.stderr
    assert out.read_text() == ""


@pytest.mark.parametrize(("args", "message"), [
    (["--input", "x.jsonl"], "--input needs --output"),
    (["--batch-size", "4"], "--batch-size only applies with --input"),
    (["hello", "--batch-size", "4"], "--batch-size only applies with --input"),
    (["hello", "-o", "x", "--batch-size", "4"], "--batch-size only applies with --input"),
    (["-i", "--output", "o.jsonl"], "--output only applies with --input"),
    (["-i", "--output", "o.jsonl", "--batch-size", "2"],
     "--output, --batch-size only apply with --input"),
    (["-i", "--input", "x.jsonl"], "--interactive and --input exclude each other"),
    (["hello", "--input", "x.jsonl", "--output", "o"], "a prompt argument cannot be combined"),
    (["--input", "missing.jsonl", "--output", "o.jsonl"], "input file missing.jsonl does not"),
    (["--input", "-", "--output", "-", "--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_cli_refuses_bad_mode_flags(args: list[str], message: str):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output


def test_cli_refuses_more_outputs_per_line_once_before_any_line(tmp_path: Path):
    """--num-return-sequences 2 was every line's error record (exit 1), each telling to
    fix the line; it is the flag that is wrong, refused once (exit 2), nothing written."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(mixed_prompts(3)) + "\n")
    result = invoke("--input", str(src), "--output", str(out), "-n", "4", "-t", "0.8",
                    "--num-return-sequences", "2")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: --num-return-sequences (or --preset): num_return_sequences must be 1, as "
        "each line gets one result, got 2; for more outputs repeat the line with other ids"]
    assert not out.exists()


def test_a_one_row_backend_runs_the_lines_one_by_one_and_says_so(tmp_path: Path):
    """--backend lean with --batch-size 4 ran each batch, failed it on the backend's
    refusal, and ran its lines again one by one, saying nothing."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(mixed_prompts(3)) + "\n")
    texts = {}
    for backend, size in (("lean", "4"), ("transformers", "1")):
        out = tmp_path / f"{backend}.jsonl"
        result = invoke("--input", str(src), "--output", str(out), "-n", "6",
                        "--backend", backend, "--batch-size", size)
        assert result.exit_code == 0, result.output
        texts[backend] = [json.loads(line)["text"] for line in out.read_text().splitlines()]
        said = "--backend lean runs one row per forward, so the lines run one by one"
        assert (said in " ".join(result.stderr.split())) == (backend == "lean")
    assert texts["lean"] == texts["transformers"]


def test_a_one_row_backend_without_batch_size_says_nothing(tmp_path: Path):
    """--backend lean alone said '--batch-size 16 is not used', a flag never given."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(mixed_prompts(2)) + "\n")
    result = invoke("--input", str(src), "--output", str(out), "-n", "3", "--backend", "lean")
    assert result.exit_code == 0, result.output
    assert "--batch-size" not in result.stderr
    assert len(read_results(out)) == 2


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_gives_every_id_once_with_clean_texts(tmp_path: Path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(mixed_prompts(16, ignore_eos=True)) + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def command(out: Path, batch_size: int) -> list[str]:
        return [sys.executable, "-m", "cli", "generate", *MODEL, "--input", str(src),
                "--output", str(out), "-n", "32", "--seed", "3", "--batch-size",
                str(batch_size)]

    killed = tmp_path / "killed.jsonl"
    log = tmp_path / "killed.stderr"
    with log.open("w") as stderr:
        proc = subprocess.Popen(command(killed, 4), cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)
        wait_for_lines(killed, 3, proc)
        proc.send_signal(signal.SIGKILL)
        code = proc.wait()
    assert killed.exists(), f"the run ended ({code}) before writing: {log.read_text()}"
    partial = len(read_results(killed))
    assert 3 <= partial < 16, "the run should have been killed midway"
    with killed.open("a") as fh:  # what a crash in the middle of a write leaves
        fh.write('{"id": "p15", "text": "half')

    resumed = subprocess.run(command(killed, 4), cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "removed a half-written last line" in resumed.stderr
    clean = tmp_path / "clean.jsonl"
    done = subprocess.run(command(clean, 7), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    resumed_records = read_results(killed)
    ids = [r["id"] for r in resumed_records]
    assert sorted(ids) == sorted(f"p{i}" for i in range(16))  # each id exactly once
    expected = {r["id"]: r["text"] for r in read_results(clean)}
    assert {r["id"]: r["text"] for r in resumed_records} == expected


# ---------------------------------------------------------------- logprobs


def test_logprobs_per_line_and_for_the_run_each_bad_value_its_own_error():
    run = gb.RunDefaults(preset_settings={}, flags={"max_new_tokens": 16}, seed=7, logprobs=2)
    items = gb.parse_lines(lines_of(
        {"id": "own", "prompt": "a", "logprobs": 5},
        {"id": "run", "prompt": "a"},
        {"id": "off", "prompt": "a", "logprobs": 0},
        {"id": "big", "prompt": "a", "logprobs": 21},
        {"id": "neg", "prompt": "a", "logprobs": -1},
        {"id": "text", "prompt": "a", "logprobs": "3"},
        {"id": "bool", "prompt": "a", "logprobs": True},
        {"id": "float", "prompt": "a", "logprobs": 2.5},
        {"id": "beam", "prompt": "a", "strategy": "beam", "num_beams": 2},
        {"id": "beam-off", "prompt": "a", "strategy": "beam", "num_beams": 2, "logprobs": 0},
    ), run)
    jobs = {i.id: i.logprobs for i in items if isinstance(i, gb.Job)}
    assert jobs == {"own": 5, "run": 2, "off": None, "beam-off": None}
    errors = {i.id: i.message for i in items if isinstance(i, gb.LineError)}
    assert errors == {
        "big": "line 4: logprobs must be 0 <= logprobs <= 20, got 21",
        "neg": "line 5: logprobs must be 0 <= logprobs <= 20, got -1",
        "text": "line 6: logprobs must be an integer (the alternatives per token, 0-20; 0: no "
                "logprobs), got '3'",
        "bool": "line 7: logprobs must be an integer (the alternatives per token, 0-20; 0: no "
                "logprobs), got True",
        "float": "line 8: logprobs must be an integer (the alternatives per token, 0-20; 0: "
                 "no logprobs), got 2.5",
        "beam": "line 9: logprobs needs strategy greedy or sample; beam search records no "
                "per-token logprobs (drop logprobs from the line, or --logprobs from the "
                "command)"}


def test_logprobs_enter_the_fingerprint_only_when_asked_for():
    line = lines_of({"id": "a", "prompt": "Once"})
    (plain,) = gb.parse_lines(line, RUN)
    (asked,) = gb.parse_lines(line, gb.RunDefaults({}, {"max_new_tokens": 16}, seed=7,
                                                    logprobs=3))
    (zero,) = gb.parse_lines(lines_of({"id": "a", "prompt": "Once", "logprobs": 0}), RUN)
    assert plain.fingerprint == zero.fingerprint  # 0 asks for none: a result stays valid
    assert asked.fingerprint != plain.fingerprint  # its result must carry the logprobs
    # the hash of a line without logprobs is what it was before logprobs existed (and
    # before grammar_timeout, which bounds a compile and changes no output, and before
    # penalty_alpha and dola_layers, which are off)
    settings = plain.settings.to_dict() | {"seed": None}
    for later in ("grammar_timeout", "penalty_alpha", "dola_layers"):
        del settings[later]
    assert plain.fingerprint == gb.fingerprint({
        "model": "", "prompt": "Once", "messages": None, "chat": False, "system": None,
        "settings": settings})


def test_grammar_timeout_leaves_the_fingerprint_as_it_was():
    line = lines_of({"id": "a", "prompt": "Once"})
    (plain,) = gb.parse_lines(line, RUN)
    (bounded,) = gb.parse_lines(line, gb.RunDefaults(
        {}, {"max_new_tokens": 16, "grammar_timeout": 5.0}, seed=7))
    assert bounded.settings.grammar_timeout == 5.0
    assert bounded.fingerprint == plain.fingerprint


def test_batched_logprobs_are_transformers_transition_scores(stories):
    """A greedy line with a repetition penalty (raw and processed logprobs differ),
    batched with a longer prompt (so its row is left-padded), against transformers'
    compute_transition_scores on output_logits (raw) and output_scores (processed)."""
    import torch

    lines = lines_of({"id": "p", "prompt": "Once upon a time", "strategy": "greedy",
                      "repetition_penalty": 1.3, "max_new_tokens": 10, "logprobs": 3},
                     {"id": "long", "prompt": " ".join(WORDS), "strategy": "greedy",
                      "repetition_penalty": 1.3, "max_new_tokens": 10, "logprobs": 3})
    jobs = gb.parse_lines(lines, RUN)
    for job in jobs:
        gb.encode(stories, job, RUN)
    finishes = {job.id: f for job, f in gb.generate_jobs(stories, jobs, 2)}
    content = finishes["p"].logprobs_object["content"]
    ids = jobs[0].ids
    out = stories.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10,
                                 repetition_penalty=1.3, output_scores=True,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0, eos_token_id=None)
    new = out.sequences[0, len(ids):].tolist()
    assert [e["id"] for e in content] == new[:len(content)] and len(content) == 10
    processed = stories.model.compute_transition_scores(out.sequences, out.scores,
                                                        normalize_logits=True)[0]
    raw = stories.model.compute_transition_scores(out.sequences, out.logits,
                                                  normalize_logits=True)[0]
    for i, entry in enumerate(content):
        assert entry["logprob"] == pytest.approx(float(raw[i]), abs=1e-4)
        assert entry["processed_logprob"] == pytest.approx(float(processed[i]), abs=1e-4)
        top = out.logits[i][0].float().log_softmax(-1).topk(3)
        assert [c["id"] for c in entry["top_logprobs"]] == top.indices.tolist()
        assert [c["logprob"] for c in entry["top_logprobs"]] == \
            pytest.approx(top.values.tolist(), abs=1e-4)
    assert any(abs(e["logprob"] - e["processed_logprob"]) > 1e-3 for e in content)


def test_cli_batch_logprobs_are_generates(tmp_path: Path):
    """Each line's `logprobs` is the object `generate --logprobs --json` writes for the
    same prompt and settings (a sampled line with its seed too); the bad line gets its
    error and the others their results."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write = [{"id": "greedy", "prompt": "Once upon a time", "strategy": "greedy"},
             {"id": "sampled", "prompt": "Tom and Lily", "temperature": 0.8, "top_k": 20,
              "seed": 5, "logprobs": 3},
             {"id": "bad", "prompt": "x", "logprobs": 99},
             {"id": "none", "prompt": "The cat", "logprobs": 0}]
    src.write_text("\n".join(map(json.dumps, write)) + "\n")
    result = invoke("--input", str(src), "--output", str(out), "-n", "8", "--batch-size",
                    "3", "--logprobs", "2")
    assert result.exit_code == 1  # the bad line
    records = {r["id"]: r for r in read_results(out)}
    assert records["bad"]["error"] == "line 3: logprobs must be 0 <= logprobs <= 20, got 99"
    assert "line 3: logprobs must be 0 <= logprobs <= 20, got 99" in result.stderr
    assert "Traceback" not in result.output
    assert "logprobs" not in records["none"] and records["none"]["text"]

    def generated(*args: str) -> dict:
        one = invoke("-n", "8", "--json", *args)
        assert one.exit_code == 0, one.output
        return json.loads(one.stdout)["outputs"][0]

    greedy = generated("Once upon a time", "-s", "greedy", "--logprobs", "2")
    sampled = generated("Tom and Lily", "-t", "0.8", "--top-k", "20", "--seed", "5",
                        "--logprobs", "3")
    # Each row is alone in its batch here (their settings differ), so the values are
    # generate's to the last digit; a left-padded row's are checked against
    # transformers above.
    for record, expected in ((records["greedy"], greedy), (records["sampled"], sampled)):
        assert record["text"] == expected["text"]
        assert record["logprobs"] == expected["logprobs"]
        assert [e["id"] for e in record["logprobs"]["content"]] == expected["token_ids"]
    assert len(records["sampled"]["logprobs"]["content"][0]["top_logprobs"]) == 3  # its own


def test_cli_adding_logprobs_to_a_finished_run_is_a_change(tmp_path: Path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": "a", "prompt": "Once upon a time"}\n')
    assert invoke("--input", str(src), "--output", str(out), "-n", "4").exit_code == 0
    refused = invoke("--input", str(src), "--output", str(out), "-n", "4", "--logprobs", "1")
    assert refused.exit_code == 2 and "--redo-changed" in refused.stderr
    redone = invoke("--input", str(src), "--output", str(out), "-n", "4", "--logprobs", "1",
                    "--redo-changed")
    assert redone.exit_code == 0, redone.output
    (record,) = read_results(out)
    assert len(record["logprobs"]["content"]) == 4
    interactive = invoke("-i", "--logprobs", "2")
    assert interactive.exit_code == 2  # the session has /set logprobs=N
    assert "--logprobs only applies to a single prompt, not with --interactive" in \
        interactive.stderr


@pytest.mark.parametrize("lines, said", [(1, "1 line · 1 generated"), (2, "2 lines · 2 generated")])
def test_the_summary_counts_lines_in_words(lines, said, monkeypatch):
    from rich.console import Console

    from cli import batch, render

    console = Console(record=True, width=200, force_terminal=False)
    monkeypatch.setattr(render, "err", console)
    batch._summary(batch.Tally(lines=lines, done=lines, tokens=8, generating_s=1.0), 1.0)
    assert console.export_text().startswith(f"{said} · 0 failed")
