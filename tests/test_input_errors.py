"""Bad input a user can give: one clear line and the right exit code (2 input, 1 runtime),
checked before the work starts, never the "unexpected" wording of a bug; and the REPL,
which survives any line and keeps every answer."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.errors import user_errors
from cli.main import app
from genlib.errors import ConfigError
from genlib.settings.config import MAX_ROWS, resolve_settings
from tests.conftest import ROOT, STORIES

runner = CliRunner()
MODEL = ["-m", str(STORIES)]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}


def invoke(*args: str, input: str | bytes | None = None):
    return runner.invoke(app, list(args), input=input)


def assert_clear(result, code: int, fragment: str) -> None:
    assert result.exit_code == code, result.output
    assert fragment in result.stderr
    assert result.stderr.strip().startswith("error:") and "unexpected" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory) -> dict[str, Path]:
    """A copy of stories260K with its weights cut short, and one of an unknown type."""
    root = tmp_path_factory.mktemp("models")
    folders = {"truncated": root / "truncated", "unknown": root / "unknown"}
    for folder in folders.values():
        folder.mkdir()
        for item in STORIES.iterdir():
            (folder / item.name).symlink_to(item)
    weights = folders["truncated"] / "model.safetensors"
    weights.unlink()
    weights.write_bytes((STORIES / "model.safetensors").read_bytes()[:5000])
    config = folders["unknown"] / "config.json"
    data = json.loads(config.read_text())
    config.unlink()
    config.write_text(json.dumps({**data, "model_type": "frobnicator",
                                  "architectures": ["FrobForCausalLM"]}))
    return folders


@pytest.mark.parametrize(("args", "code", "fragment"), [
    (["generate", "x", "-m", ""], 2, "--model is empty"),
    (["generate", "x", *MODEL, "--seed", str(2**64)], 2,
     "seed must be 0 <= seed <= 2**64-1 (18446744073709551615), got 18446744073709551616"),
    (["beam", "x", *MODEL, "--num-beams", "300000"], 2,
     f"num_beams must be 1 <= num_beams <= {MAX_ROWS}, got 300000"),
    (["generate", "x", *MODEL, "-t", "0.5", "--num-return-sequences", "300000"], 2,
     f"num_return_sequences must be 1 <= num_return_sequences <= {MAX_ROWS}"),
    (["generate", "Once " * 2_000_000, *MODEL], 2,
     "characters) cannot fit in the model's 512 positions with max_new_tokens 128"),
    (["generate", "Once " * 300, *MODEL, "-n", "600"], 2,
     "max_new_tokens (600) leaves no room for the prompt in the model's 512 positions; "
     "lower it so that the prompt's tokens and it fit in 512"),
    (["speculate", "x", *MODEL, "--prompt-lookup", "2", "--num-draft-tokens", "0"], 2,
     "--num-draft-tokens must be 1 to 64, got 0"),
    (["bench", *MODEL, "--csv", "/", "--runs", "1"], 2, "--csv / is a directory"),
    (["bench", *MODEL, "--csv", "/nonexistent-dir/x.csv"], 2, "does not exist"),
    (["bench", *MODEL, "--threads", "100000"], 2, "--threads 100000 is more than 4 per "
                                                  "logical CPU"),
    (["generate", "x", *MODEL, "-n", "2", "--logit-bias", "600=1"], 2,
     "logit_bias token id 600 is outside the model's vocabulary (0-511)"),
    (["beam", "x", *MODEL, "-n", "2", "--logit-bias", "512=1"], 2,
     "logit_bias token id 512 is outside the model's vocabulary (0-511)"),
    (["explain", "x", *MODEL, "-n", "2", "--logit-bias", "9999=1"], 2,
     "logit_bias token id 9999 is outside"),
    (["speculate", "x", *MODEL, "--prompt-lookup", "2", "--logit-bias", "600=1"], 2,
     "logit_bias token id 600 is outside"),
    (["explain", "x", *MODEL, "-n", "2", "--html", "/nonexistent-dir/x.html"], 2,
     "--html /nonexistent-dir/x.html: folder /nonexistent-dir does not exist"),
    (["explain", "x", *MODEL, "-n", "2", "--html", "/"], 2, "--html / is a directory"),
    (["generate", "x", *MODEL, "-n", "2", "-o", "/nonexistent-dir/x.txt"], 2,
     "-o/--output /nonexistent-dir/x.txt: folder /nonexistent-dir does not exist"),
    (["compare", "x", *MODEL, "-n", "2", "--markdown", "/"], 2, "--markdown / is a directory"),
    (["compare", "x", "-n", "2", "--models", ","], 2, "--models names no model"),
    (["generate", "x", *MODEL, "-p", "/"], 2, "preset / is a folder; give a preset file"),
])
def test_bad_input_is_one_clear_line(args: list[str], code: int, fragment: str):
    assert_clear(invoke(*args), code, fragment)


def test_model_folders_that_cannot_load_say_why(broken_models):
    truncated = invoke("generate", "x", "-m", str(broken_models["truncated"]))
    assert_clear(truncated, 2, "cannot be read (Error while deserializing header")
    assert "damaged or incomplete" in truncated.stderr
    unknown = invoke("generate", "x", "-m", str(broken_models["unknown"]))
    assert_clear(unknown, 2, "model type 'frobnicator' is not an architecture transformers")
    assert "cache" not in unknown.stderr


def test_the_largest_seed_runs(tmp_path: Path):
    result = invoke("generate", "Once", *MODEL, "-n", "3", "-t", "0.8", "--seed", str(2**64 - 1),
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["settings"]["seed"] == 2**64 - 1


def test_huge_values_are_quoted_short():
    with pytest.raises(ConfigError) as caught:
        resolve_settings({"stop_strings": ["x"] * 1_000_000 + [1]})
    assert len(str(caught.value)) < 300


def test_a_draft_with_a_smaller_vocabulary_is_refused_before_any_work():
    """The draft's vocabulary is checked before the warm-up feeds it the target's
    tokens (code-target's ids go past stories260K's 512)."""
    from tests.conftest import SHARED_MODELS

    result = invoke("speculate", "def f(", "-m", str(SHARED_MODELS / "code-target"), "-d",
                    str(STORIES), "-n", "3")
    assert_clear(result, 2, "does not share the vocabulary of target")
    assert "(512 vs 8192 output tokens)" in result.stderr


def test_a_grammar_file_that_is_not_text_is_refused(tmp_path: Path):
    binary = tmp_path / "g.bin"
    binary.write_bytes(b"\xc5\xff\x00root")
    for flag in ("--grammar", "--json-schema"):
        assert_clear(invoke("generate", "x", *MODEL, "-n", "2", flag, str(binary)), 2,
                     f"{flag}: {binary} is not UTF-8 text (byte 0)")
    assert_clear(invoke("generate", "x", *MODEL, "-n", "2", "--grammar", "-",
                        input=b"\xff root"), 2, "--grammar: stdin is not UTF-8 text")


def test_two_inputs_from_stdin_are_refused_before_either_reads_it(tmp_path: Path):
    """The first reader took all of stdin and the other got nothing: `--input -` with
    `--json-schema -` ran zero lines and wrote an empty results file, exit 0."""
    out = tmp_path / "out.jsonl"
    line = '{"id": "q1", "prompt": "Once upon a time"}\n'
    assert_clear(invoke("generate", *MODEL, "--input", "-", "-o", str(out), "--json-schema",
                        "-", input=line), 2,
                 "--json-schema - and --input - would both read stdin; give all but one as "
                 "a file or an argument")
    assert not out.exists()
    for command in ("generate", "compare"):
        for prompt in ([], ["-"]):
            assert_clear(invoke(command, *prompt, *MODEL, "--grammar", "-",
                                input='root ::= "a"'), 2,
                         "--grammar - and the prompt would both read stdin")


def test_a_schema_on_stdin_beside_a_prompt_argument_is_read():
    """The prompt is an argument: stdin has one reader, the schema's."""
    pytest.importorskip("xgrammar", reason="the grammar extra: pip install 'genlab[grammar]'")
    result = invoke("generate", "Num:", *MODEL, "-n", "2", "--json-schema", "-",
                    input='{"type": "integer"}')
    assert result.exit_code == 0, result.output


def test_a_crlf_line_end_on_stdin_is_not_part_of_the_prompt():
    result = invoke("generate", *MODEL, "-n", "3", "--json", input="Once upon a time\r\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt"] == "Once upon a time"


def test_duplicate_keys_in_a_preset_are_refused(tmp_path: Path):
    preset = tmp_path / "p.yaml"
    preset.write_text("temperature: 0.5\ntop_p: 0.9\ntemperature: 0.7\n")
    assert_clear(invoke("generate", "x", *MODEL, "-n", "2", "-p", str(preset)), 2,
                 "line 3: not valid YAML (the key 'temperature' appears twice; keep one)")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_is_one_clear_line_not_a_bug():
    result = subprocess.run([sys.executable, "-m", "cli", "generate", "x", *MODEL, "-n", "2",
                             "--json", "-o", "/dev/full"], capture_output=True, text=True,
                            env=ENV, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == ("error: cannot write: no space left on the device; "
                                     "free some space, or write elsewhere")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["--version"], ["generate", "--help"], ["presets", "--help"]])
def test_help_and_version_on_a_full_disk_are_one_line_not_a_traceback(args):
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "cli", *args], stdout=full,
                                stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    assert (result.returncode, result.stderr.strip()) == (1, (
        "error: cannot write: no space left on the device; free some space, or write "
        "elsewhere"))


def test_version_with_stdout_closed_says_so():
    result = subprocess.run([sys.executable, "-m", "cli", "--version"], stdout=None,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                            preexec_fn=lambda: os.close(1))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().startswith("error: standard output is closed")


def test_binary_stdin_and_non_utf8_arguments_are_refused():
    assert_clear(invoke("generate", *MODEL, input=b"\x00\xff\xfe binary"), 2,
                 "stdin is not UTF-8 text (byte 0xff at offset 1)")
    assert_clear(invoke("generate", "caf\udce9", *MODEL), 2,
                 "the prompt argument is not valid UTF-8 text (character 4)")


def test_a_closed_stdin_reads_as_empty():
    """Started with stdin closed (`<&-`), a command that reads it said "unexpected
    AttributeError"; it now reads it as empty and says so."""
    for prompt in ("", "-"):
        closed = subprocess.run(
            ["sh", "-c", f"exec {sys.executable} -m cli generate {prompt} -m {STORIES} "
                         f"-n 2 <&-"], cwd=ROOT, env=ENV, capture_output=True, text=True,
            timeout=120)
        assert closed.returncode == 2, closed.stderr
        assert closed.stderr.strip() == "error: the prompt read from stdin is empty"


@pytest.mark.parametrize("how", [
    "exec {python} -m cli {args} 2>&-",  # closed: Python starts without a stderr
    "exec {python} -m cli {args} 2</dev/null",  # a file open for reading only, where a
])  # launcher script (pyenv's shims) leaves its own in the closed stderr's place
@pytest.mark.parametrize("to_file", [False, True])
def test_a_closed_stderr_costs_no_output_when_something_warns(how, to_file, tmp_path):
    """xgrammar logs on descriptor 2 while it compiles `a$b`, and genlab warns: with
    stderr closed, the warning goes nowhere, and the document is written, exit 0. With
    `-o FILE` the file is opened after the start, where a closed descriptor 2 would let
    it take 2 and the log land in it. With `2>&-` an import opens a file first and takes
    2 itself, so the mend shows in the `2</dev/null` runs, and in the test below."""
    pytest.importorskip("xgrammar")
    out = tmp_path / "out.json"
    args = f"generate x -m {STORIES} --regex 'a$b' -n 3 --json" + (f" -o {out}" * to_file)
    run = subprocess.run(["sh", "-c", how.format(python=sys.executable, args=args)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0
    written = out.read_text() if to_file else run.stdout
    assert "Warning" not in written
    assert json.loads(written)["outputs"][0]["text"] == "ab"


def test_a_closed_descriptor_2_gets_dev_null_before_any_file_can_take_it():
    """The `2>&-` runs above pass however the CLI starts, when an import opens a file
    that takes the closed descriptor first: here descriptor 2 is closed right before
    `stderr_to_devnull`, so a file opened after it would take 2 unless it is mended."""
    code = ("import os, sys; from cli.errors import stderr_to_devnull; os.close(2); "
            "sys.stderr = None; stderr_to_devnull(); f = open(os.devnull, 'rb'); "
            "print(os.path.samestat(os.fstat(2), os.stat(os.devnull)), f.fileno() != 2, "
            "sys.stderr.fileno())")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["True", "True", "2"], run.stdout + run.stderr


def test_closed_stdout_and_an_encoding_that_lacks_characters():
    for how in ("exec {python} -m cli presets show creative >&-",  # closed from the start
                "exec {python} -c 'import os; os.close(1); from cli.main import run; run()' "
                "presets show creative"):  # closed while running
        closed = subprocess.run(["sh", "-c", how.format(python=sys.executable)], cwd=ROOT,
                                env=ENV, capture_output=True, text=True, timeout=120)
        assert closed.returncode == 2, closed.stderr
        assert closed.stderr.startswith("error: standard output is closed")
    ascii_json = subprocess.run([sys.executable, "-m", "cli", "generate", "café", *MODEL,
                                 "-n", "2", "--json"], cwd=ROOT, capture_output=True,
                                env={**ENV, "PYTHONIOENCODING": "ascii"}, timeout=120)
    assert ascii_json.returncode == 0, ascii_json.stderr
    assert json.loads(ascii_json.stdout)["prompt"] == "café"  # escaped, not refused

    @user_errors
    def prints_a_snowman() -> None:
        raise UnicodeEncodeError("ascii", "☃", 0, 1, "ordinal not in range(128)")

    with pytest.raises(typer.Exit) as caught:
        prints_a_snowman()
    assert caught.value.exit_code == 1


# ---------------------------------------------------------------- the REPL


@pytest.fixture
def session(stories):
    from cli.repl import Session

    settings = resolve_settings({"max_new_tokens": 6})
    return Session(lm=stories, flags={"max_new_tokens": 6}, preset=None, settings=settings)


def drive(monkeypatch, session, lines: list[str]) -> None:
    """Run the REPL loop on `lines` as typed input, then Ctrl-D."""
    from cli import repl

    typed = iter(lines)

    def read(self) -> str:
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(repl.PromptReader, "read", read)
    repl.loop(session)


def test_repl_survives_bad_lines_and_faults_and_keeps_every_answer(
        monkeypatch, session, capsys, tmp_path: Path):
    from cli import repl

    real = repl.stream_answer
    calls = {"n": 0}

    def fails_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("the forward pass broke")
        return real(*args, **kwargs)

    monkeypatch.setattr(repl, "stream_answer", fails_once)
    saved = tmp_path / "s.jsonl"
    drive(monkeypatch, session, ["Once upon a time", f"/seed {2**64}", "caf\udce9",
                                 "Tom and Lily", "/set temperature=0.5", f"/seed {2**64 - 1}",
                                 "The cat", f"/save {saved}"])
    err = capsys.readouterr().err
    assert "/seed: seed must be 0 <= seed <= 2**64-1" in err
    assert "that line is not valid UTF-8 (character 4); nothing was run" in err
    assert "unexpected RuntimeError: the forward pass broke (the session goes on" in err
    turns = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [t["prompt"] for t in turns] == ["Once upon a time", "The cat"]
    assert turns[0]["output"] == ", there was a little g"  # 6 tokens
    assert turns[1]["settings"]["seed"] == 2**64 - 1


def test_save_replaces_only_its_own_file_unless_told(monkeypatch, session, capsys, tmp_path):
    """A file the session did not write stays, with one line naming /save!; the session
    rewrites its own; /save! replaces; a failed write leaves the old file whole."""
    from genlib import jsonl

    notes, mine = tmp_path / "notes.jsonl", tmp_path / "s.jsonl"
    notes.write_text("mine\n")
    notes.chmod(0o640)
    (tmp_path / "link.jsonl").symlink_to(notes)
    drive(monkeypatch, session, ["Once upon a time", f"/save {notes}", f"/save {mine}",
                                 "The cat", f"/save {mine}", f"/save {tmp_path}"])
    err = capsys.readouterr().err
    assert f"{notes} exists; /save! {notes} replaces it, or /save another name" in err
    assert notes.read_text() == "mine\n"
    assert [json.loads(line)["prompt"] for line in mine.read_text().splitlines()] == \
        ["Once upon a time", "The cat"]
    assert f"cannot write {tmp_path} (" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "notes.jsonl",
                                                          "s.jsonl"]

    real, calls = jsonl.dumps, []

    def full_after_one_line(record):
        calls.append(record)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(record)

    monkeypatch.setattr(jsonl, "dumps", full_after_one_line)
    drive(monkeypatch, session, [f"/save! {notes}"])
    assert "cannot write" in capsys.readouterr().err and notes.read_text() == "mine\n"
    monkeypatch.setattr(jsonl, "dumps", real)
    drive(monkeypatch, session, [f"/save! {tmp_path / 'link.jsonl'}"])
    assert "saved 2 turns" in capsys.readouterr().err
    assert len(notes.read_text().splitlines()) == 2 and (tmp_path / "link.jsonl").is_symlink()
    assert notes.stat().st_mode & 0o777 == 0o640  # a file replaced keeps its permissions
    umask = os.umask(0)
    os.umask(umask)
    assert mine.stat().st_mode & 0o777 == 0o666 & ~umask  # a new one: open()'s
    drive(monkeypatch, session, [f"/save {tmp_path / 'no' / 'such' / 's.jsonl'}"])
    assert f"cannot write {tmp_path / 'no' / 'such' / 's.jsonl'}: there is no folder" in \
        capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_repl_refuses_a_bias_outside_the_vocabulary_and_clears_a_setting(
        monkeypatch, session, capsys):
    drive(monkeypatch, session, ["/set logit_bias=9999=1", "/set logit_bias=400=2",
                                 "/set top_p=0.9", "/set nosuch=",
                                 "/set temperature=0.7,logit_bias=,top_p="])
    err = capsys.readouterr().err
    assert "logit_bias token id 9999 is outside the model's vocabulary (0-511)" in err
    assert "/set nosuch=: no such setting" in err
    assert "cleared logit_bias, top_p" in err
    assert session.settings.logit_bias == () and session.settings.top_p == 1.0
    assert session.settings.temperature == 0.7


def test_repl_reads_non_utf8_bytes_as_a_refusable_line(monkeypatch):
    from cli import repl

    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9\nok\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    repl._lenient_stdin()
    assert not repl.valid_text(sys.stdin.readline().rstrip("\n"))
    assert sys.stdin.readline() == "ok\n"  # the stream goes on after the bad line


def test_a_session_ended_by_a_fault_keeps_its_turns(monkeypatch, session, tmp_path: Path):
    from cli import repl

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr("platformdirs.user_data_dir", lambda name: str(tmp_path / name))
    session.turns.append({"turn": 1, "prompt": "p", "output": "o"})
    path = repl.rescue(session)
    assert path is not None and json.loads(path.read_text()) == session.turns[0]


def test_a_step_torch_cannot_compile_is_one_clear_line(monkeypatch):
    """torch.compile failing on a machine (as it did on a GPU in bfloat16 with torch 2.11)
    is no bug report: one line naming the torch, dtype and device, and the backend that
    runs without compiling; the prefill's token is already out."""
    import torch._dynamo

    from genlib.backends.llama import LeanLlama

    def step_with_a_graph_break(self, *args):
        torch._dynamo.graph_break()  # fullgraph: dynamo refuses it

    monkeypatch.setattr(LeanLlama, "_static_step", step_with_a_graph_break)
    result = invoke("generate", "Once upon a time", *MODEL, "--backend", "compiled",
                    "-n", "8")
    assert_clear(result, 1, f"torch {torch.__version__} could not compile the step in "
                            f"float32 on cpu (Unsupported: ")
    assert result.stderr.strip().endswith("--backend lean runs the same forward uncompiled")
    assert result.stdout == ","  # the prefill's token, streamed before the first step


LONG_NAME = "x" * 300 + ".html"


@pytest.mark.parametrize(("args", "fragment"), [
    (["explain", "x", "--html", "/proc/x.html"],
     "--html /proc/x.html: cannot create a file in /proc; pick another path"),
    (["explain", "x", "--html", f"/tmp/{LONG_NAME}"],
     f"--html /tmp/{LONG_NAME}: the name is too long (305 bytes; this file system allows"),
    (["explain", "x", "--html", "/nonexistent-dir/x.html"],
     "--html /nonexistent-dir/x.html: folder /nonexistent-dir does not exist"),
    (["explain", "x", "--html", "/etc/hostname/x.html"],
     "--html /etc/hostname/x.html: /etc/hostname is a file, not a folder"),
    (["generate", "x", "-o", f"/tmp/{LONG_NAME}"], "-o/--output /tmp/x"),
    (["beam", "x", "--json", "-o", "/proc/x.json"], "-o/--output /proc/x.json: cannot create"),
    (["compare", "x", "--markdown", "/proc/x.md"], "--markdown /proc/x.md: cannot create"),
    (["bench", "--csv", "/proc/x.csv"], "--csv /proc/x.csv: cannot create"),
    (["bench", "--plot", f"/tmp/{LONG_NAME}"], "the name is too long"),
    (["speculate", "x", "--prompt-lookup", "2", "--json", "-o", "/proc/x.json"],
     "-o/--output /proc/x.json: cannot create"),
    (["generate", "--input", str(ROOT / "pyproject.toml"), "--output", "/proc/x.jsonl"],
     "--output /proc/x.jsonl: cannot create"),
])
def test_an_output_path_that_cannot_be_written_fails_before_the_model_loads(
        args: list[str], fragment: str, monkeypatch):
    import genlib.models.loading

    def no_load(*_: object, **__: object):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(genlib.models.loading, "load_model", no_load)
    if "--plot" in args:
        pytest.importorskip("matplotlib")  # without it, --plot is refused for that first
    result = invoke(args[0], *MODEL, *args[1:])
    assert_clear(result, 2, fragment)
    assert LONG_NAME not in os.listdir("/tmp")


NOT_UTF8 = "\udcff"  # how Python hands over an argument's byte 0xff


@pytest.mark.parametrize("args, fragment", [
    (["generate", "x", "--stop", NOT_UTF8, "--json"], "stop_strings holds \\udcff, which is "
     "not text (a byte that is not UTF-8, or half of a surrogate pair); give it as UTF-8 text"),
    (["generate", "x", "--logit-bias", f"{NOT_UTF8}=1"], "logit_bias holds \\udcff"),
    (["generate", "x", "--regex", NOT_UTF8], "regex holds \\udcff"),
    (["beam", "x", "--force", NOT_UTF8], "force_words holds \\udcff"),
    (["generate", "x", "--stop", "\ud800", "--jsonl"], "stop_strings holds \\ud800"),
    (["explain", "x", "--branch", f"0:{NOT_UTF8}"],
     "--branch is not valid UTF-8 text (character 3); genlab reads text as UTF-8"),
    (["generate", "x", "--chat", "--system", NOT_UTF8],
     "--system is not valid UTF-8 text (character 1)"),
])
def test_flag_values_that_are_not_text_are_refused_in_one_line(args, fragment):
    """Each was an "unexpected" TypeError or UnicodeEncodeError (exit 1), the JSON ones
    after the text was generated."""
    assert_clear(invoke(*args, *MODEL, "-n", "3"), 2, fragment)


def test_a_bad_escape_names_the_flag_it_is_in():
    """--dry-sequence-breaker's bad escape was blamed on --stop."""
    assert_clear(invoke("generate", "x", *MODEL, "-n", "2", "--dry-multiplier", "1",
                        "--dry-sequence-breaker", "\\x"), 2,
                 "error: --dry-sequence-breaker '\\\\x': truncated \\xXX escape")


def test_a_rerank_model_too_short_for_the_run_is_the_one_named():
    """It said "the model's 256 positions ... shorten the prompt" of a 2-token prompt on a
    512-position model: the 256 were the rerank model's."""
    from tests.conftest import LLAMA2XS

    assert_clear(invoke("generate", "Once", *MODEL, "-n", "300", "--samples", "2", "-t", "1",
                        "--rerank", str(LLAMA2XS)), 2,
                 f"exceeds the rerank model {LLAMA2XS}'s 256 positions; lower max_new_tokens "
                 f"to 254 or rerank with a model of a longer context")


@pytest.mark.parametrize("command", ["generate", "speculate"])
def test_an_empty_prompt_on_a_model_without_bos_says_what_to_give(command):
    from tests.conftest import CODE_TARGET

    extra = ["--prompt-lookup", "2"] if command == "speculate" else []
    assert_clear(invoke(command, "", "-m", str(CODE_TARGET), "-n", "3", *extra), 2,
                 "error: every prompt needs at least one token, and this model's tokenizer "
                 "adds none (no BOS) to an empty prompt: give some text")


def test_branch_after_a_beam_answer_says_what_to_set(monkeypatch, session, capsys):
    drive(monkeypatch, session, ["/set strategy=beam num_beams=2", "Once upon a time",
                                 "/branch 1 #370"])
    err = capsys.readouterr().err
    assert ("/branch replays a greedy or sampled answer, and this one came from beam "
            "search; /set strategy=greedy (or sample), answer, then /branch") in err
    assert "--logprobs" not in err and "--crn" not in err


def test_a_branch_cut_short_says_it_was_interrupted(capsys):
    """A Ctrl-C during /branch ends a run "interrupted": the note says so, not that the
    run ended on its own."""
    from cli.render_explain import show_branch

    def run(tokens, reason, **extra):
        return {"steps": [{"step": i, "token": t} for i, t in enumerate(tokens)],
                "finish_reason": reason, **extra}

    original = run(["a", "b", "c", "d"], "length")
    show_branch(original, run(["a"], "interrupted", step=2, diverges_at=None))
    assert "interrupted (Ctrl-C) after 1 step, before step 2: nothing was forced" in \
        capsys.readouterr().out
    show_branch(original, run(["a", "x"], "interrupted", step=1, diverges_at=1))
    said = capsys.readouterr().out
    assert "they diverge at step 1" in said
    assert "the branch stopped early (Ctrl-C, finish: interrupted)" in said
    show_branch(original, run(["a", "x", "y", "z"], "length", step=1, diverges_at=1))
    assert "interrupted" not in capsys.readouterr().out
