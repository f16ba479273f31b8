"""`genlab generate --interactive`, driven through a real pseudo-terminal (pexpect):
typing, multi-line input, settings with preset-identical validation, Ctrl-C during a
long generation, /save, history across sessions, and the ways out."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli.repl import read_prompt
from tests.conftest import LLAMA2XS, ROOT, STORIES

pexpect = pytest.importorskip("pexpect")

PROMPT = "genlab> "
UP = "\x1b[A"


def feed(*lines: str):
    it = iter(lines)
    return lambda _prompt: next(it)


def test_multi_line_input_by_backslash_and_triple_quotes():
    assert read_prompt(feed("one line")) == "one line"
    assert read_prompt(feed("first\\", "second\\", "third")) == "first\nsecond\nthird"
    assert read_prompt(feed('"""', "a", "  b", '"""')) == "a\n  b"
    assert read_prompt(feed('"""start', 'end"""')) == "start\nend"
    assert read_prompt(feed('"""inline"""')) == "inline"


def spawn(tmp_path: Path, *args: str):
    env = {**os.environ, "GENLAB_HISTORY": str(tmp_path / "history"), "NO_COLOR": "1",
           "HF_HUB_OFFLINE": "1", "TERM": "xterm"}
    child = pexpect.spawn(sys.executable, ["-m", "cli", "generate", "-i", "-m", str(STORIES),
                                           *args], cwd=str(ROOT), env=env, encoding="utf-8",
                          timeout=60, dimensions=(40, 200))
    child.expect_exact(PROMPT)
    return child


@pytest.mark.slow
def test_session_generates_validates_settings_interrupts_and_saves(tmp_path: Path):
    child = spawn(tmp_path, "-n", "20")
    child.sendline("Once upon a time")
    child.expect_exact("there was a little girl named Lily.")
    child.expect_exact("finish: length")
    child.expect_exact(PROMPT)

    child.sendline("/set temprature=0.5")  # the same message a preset file gets
    child.expect_exact("/set: unknown setting 'temprature' (did you mean 'temperature'?)")
    child.sendline("/set temperature=0.5 top_p=7")  # one bad value: nothing changes
    child.expect_exact("/set: top_p must be 0 < top_p <= 1, got 7.0")
    child.sendline("/show")
    child.expect_exact('strategy = "greedy"')
    child.expect_exact("temperature = 1.0\r\n")
    child.sendline("/set temperature=0.5")
    child.expect_exact("set temperature=0.5")
    child.sendline("/seed 11")
    child.expect_exact("seed 11")
    child.sendline("/show")
    child.expect_exact('strategy = "sample"')
    child.expect_exact("temperature = 0.5   (set)")
    child.expect_exact("seed = 11   (set)")

    child.sendline("/chat on")  # stories260K has no chat template: an error, not an exit
    child.expect_exact("has no chat template")
    child.sendline("/nope")
    child.expect_exact("unknown command /nope")

    # A long generation, stopped with Ctrl-C: back at the prompt, session still alive.
    child.sendline("/set max_new_tokens=400 ignore_eos=true")
    child.expect_exact("set max_new_tokens=400")
    child.sendline("Tom\\")
    child.sendline("and Lily")
    child.expect(r"and Lily\r\n.{20}")  # some of the answer has streamed
    child.sendintr()
    child.expect_exact("finish: interrupted")
    child.expect_exact(PROMPT)

    saved = tmp_path / "session.jsonl"
    child.sendline(f"/save {saved}")
    child.expect_exact("saved 2 turns")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    first, second = [json.loads(x) for x in saved.read_text().splitlines()]
    assert first["prompt"] == "Once upon a time" and first["finish_reason"] == "length"
    assert first["output"].startswith(", there was a little girl named Lily.")
    assert first["settings"]["strategy"] == "greedy"
    assert second["prompt"] == "Tom\nand Lily" and second["finish_reason"] == "interrupted"
    assert 0 < second["new_tokens"] < 400
    assert second["settings"]["temperature"] == 0.5 and second["settings"]["seed"] == 11


@pytest.mark.slow
def test_history_persists_and_ctrl_d_and_ctrl_c_exit_cleanly(tmp_path: Path):
    child = spawn(tmp_path, "-n", "5")
    child.sendline("/seed 42")
    child.expect_exact("seed 42")
    child.expect_exact(PROMPT)
    child.sendeof()  # Ctrl-D
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "/seed 42" in (tmp_path / "history").read_text()

    child = spawn(tmp_path, "-n", "5")
    child.send(UP + "\r")  # the arrow key recalls the last session's line
    child.expect_exact("seed 42")
    child.expect_exact(PROMPT)
    child.send("half typed")
    child.expect_exact("half typed")
    child.sendintr()  # Ctrl-C on a typed line drops the line only
    child.expect_exact(PROMPT)
    child.sendintr()  # Ctrl-C at an empty prompt leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.slow
def test_logprobs_branch_and_show_sources(tmp_path: Path):
    child = spawn(tmp_path, "-n", "8", "--seed", "3", "-t", "0.9")
    child.sendline("/set logprobs=2")
    child.expect_exact("logprobs 2")
    child.sendline("/set logprobs=99")
    child.expect_exact("logprobs takes 0-20")
    child.sendline("/branch 2 #370")
    child.expect_exact("/branch needs an answer first")
    child.sendline("Once upon a time")
    child.expect_exact("logprobs (raw model / processed)")
    child.expect_exact("processed")
    child.expect_exact(PROMPT)
    child.sendline("/branch 2 #370")
    child.expect(r"original.*branch")
    child.expect(r"diverge|no divergence")
    child.expect_exact(PROMPT)
    child.sendline("/show")
    child.expect_exact("temperature = 0.9   (set)")
    child.expect_exact("top_k = 0\r\n")
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def piped(tmp_path: Path, lines: list[str], *args: str, model: Path = STORIES):
    """A session fed `lines` on a pipe; its CompletedProcess (stdout: the answers)."""
    env = {**os.environ, "GENLAB_HISTORY": str(tmp_path / "history"), "NO_COLOR": "1",
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "cli", "generate", "-i", "-m", str(model),
                           *args], input="".join(f"{line}\n" for line in lines),
                          capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=120)


def errors(stderr: str) -> list[str]:
    """The error lines, without the prompts written before them (on stderr, piped)."""
    return [re.sub(r"^(genlab> |\.{7} )+", "", line) for line in stderr.splitlines()
            if "error:" in line]


@pytest.mark.slow
def test_bad_seed_and_branch_arguments_are_one_line_each_and_change_nothing(tmp_path: Path):
    saved = tmp_path / "session.jsonl"
    result = piped(tmp_path, ["Once upon a time", "/seed", "/branch x #3", "/branch 8 #3",
                              "Once upon a time " * 150, "Tom", f"/save {saved}"],
                   "-n", "8", "-t", "0.8", "--seed", "5")
    assert result.returncode == 0, result.stderr
    assert errors(result.stderr) == [
        "error: /seed needs a number, e.g. /seed 3 (/seed off: a fresh one each turn)",
        "error: /branch needs STEP TOKEN, e.g. /branch 3 #421 (a token id) or /branch 3 the "
        "(a text that is one token; a leading space is tried too); STEP counts the answer's "
        "tokens from 0",
        "error: /branch step 8 is past the answer's max_new_tokens (8); steps count from 0",
        # -i takes no --truncate-prompt: the remedy is one the session has
        "error: the prompt alone (602 tokens) fills the model's 512 positions; shorten the "
        "prompt"]
    turns = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [t["settings"]["seed"] for t in turns] == [5, 5]  # /seed alone kept the seed


@pytest.mark.slow
def test_chat_without_a_template_given_at_start_is_a_usage_error(tmp_path: Path):
    result = piped(tmp_path, ["Once upon a time"], "--chat", "-n", "4")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: {STORIES} has no chat template, so --chat cannot be used; drop --chat to "
        f"give the prompt as plain text")
    assert result.stdout == ""


@pytest.mark.slow
def test_a_conversation_past_the_context_points_to_reset(tmp_path: Path):
    folder = tmp_path / "model"
    folder.mkdir()
    for item in LLAMA2XS.iterdir():
        (folder / item.name).symlink_to(item)
    config = json.loads((LLAMA2XS / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    saved = tmp_path / "session.jsonl"
    result = piped(tmp_path, ["Once upon a time", "Tell me more", "And more", "/reset",
                              "And more", f"/save {saved}"],
                   "--chat", "--system", "You are a storyteller", "-n", "60", model=folder)
    assert result.returncode == 0, result.stderr
    [error] = errors(result.stderr)
    assert error.endswith("exceeds the model's 256 positions; lower max_new_tokens to 56 or "
                          "/reset to forget the conversation's earlier turns"), error
    turns = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [t["prompt"] for t in turns] == ["Once upon a time", "Tell me more", "And more"]
    system = {"role": "system", "content": "You are a storyteller"}
    assert turns[1]["messages"] == [  # each turn: the conversation its answer followed
        system, {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": turns[0]["output"]},
        {"role": "user", "content": "Tell me more"}]
    assert turns[2]["messages"] == [system, {"role": "user", "content": "And more"}]


@pytest.mark.slow
@pytest.mark.parametrize("last,message", [
    (['"""', "Tom had", "a ball"],
     'error: the input ended inside a """ block, so that prompt (2 lines) was not run; '
     'close the block with """'),
    (["Tom had \\"],
     "error: the input ended after a line ending in a backslash, so that prompt (1 line) "
     "was not run; end the prompt's last line without one"),
], ids=["block", "backslash"])
def test_input_that_ends_inside_a_prompt_says_so_and_exits_2(tmp_path: Path, last, message):
    """A piped file whose last prompt was never closed ended the session with exit 0, the
    prompt silently dropped."""
    result = piped(tmp_path, ["Once upon a time", *last], "-n", "5")
    assert result.returncode == 2, result.stderr
    assert result.stdout.startswith(", there was a little")  # the answer before it
    assert errors(result.stderr) == [message]


@pytest.mark.slow
def test_logprobs_cleared_with_an_empty_value_and_beam_says_it_shows_none(tmp_path: Path):
    """`/set logprobs=` was refused (`takes 0-20`) where every other `KEY=` resets; with
    strategy beam the answers showed no logprobs and said nothing."""
    result = piped(tmp_path, ["/set logprobs=2", "/set strategy=beam num_beams=2",
                              "Once upon a time", "/set logprobs=", "Once upon a time"],
                   "-n", "4")
    assert result.returncode == 0, result.stderr
    assert errors(result.stderr) == []
    warned = [line for line in result.stderr.splitlines() if "warning:" in line]
    assert len(warned) == 1 and warned[0].endswith(
        "warning: beam search keeps no per-token logprobs to show; /set logprobs=0, or "
        "another strategy")
    assert "logprobs 0" in result.stderr


@pytest.mark.slow
def test_a_refused_set_leaves_logprobs_as_they_were(tmp_path: Path):
    """`/set logprobs=3 temperature=abc` is refused as a whole: logprobs stay off, as the
    temperature does (it said `logprobs 3` and kept them on beside the error)."""
    result = piped(tmp_path, ["/set logprobs=3 temperature=abc", "/show"], "-n", "4")
    assert result.returncode == 0, result.stderr
    assert errors(result.stderr) == ["error: /set: temperature must be a number, got 'abc'"]
    assert "logprobs 3" not in result.stderr
    assert "logprobs: 0" in result.stdout + result.stderr


def test_a_reader_that_goes_away_ends_the_session(tmp_path: Path):
    """Each later turn said "unexpected BrokenPipeError (the session goes on)" and was
    generated into the closed pipe; now the first failed write ends it with 141."""
    env = {**os.environ, "GENLAB_HISTORY": str(tmp_path / "history"), "NO_COLOR": "1",
           "XDG_DATA_HOME": str(tmp_path)}
    session = subprocess.Popen([sys.executable, "-m", "cli", "generate", "-i", "-m",
                                str(STORIES), "-n", "30"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=str(ROOT), env=env)
    session.stdin.write("Once upon a time\n" * 40)
    session.stdin.close()
    session.stdout.readline()
    session.stdout.close()
    stderr = session.stderr.read()
    assert session.wait(timeout=120) == 141, stderr
    assert "unexpected" not in stderr and stderr.count("genlab> ") < 40


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_ends_the_session_in_one_line(tmp_path: Path):
    env = {**os.environ, "GENLAB_HISTORY": str(tmp_path / "history"), "NO_COLOR": "1",
           "XDG_DATA_HOME": str(tmp_path)}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "cli", "generate", "-i", "-m",
                               str(STORIES), "-n", "30"], input="Once\nThe dog\n",
                              stdout=full, stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
                              env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    assert errors(done.stderr) == ["error: cannot write: no space left on the device; free "
                                   "some space, or write elsewhere"]


def test_a_first_chat_message_too_long_is_told_to_shorten_not_to_reset(tmp_path: Path):
    """/reset forgets earlier turns; with none, it cannot help."""
    long = "x = [" + ", ".join(map(str, range(180))) + "]"
    done = piped(tmp_path, ["/chat on", long], "-n", "20", model="builtin:code-small")
    assert errors(done.stderr) == [
        "error: the prompt alone (550 tokens) fills the model's 512 positions; shorten "
        "the prompt"]
