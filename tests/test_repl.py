"""`genlab generate --interactive`, driven through a real pseudo-terminal (pexpect):
typing, multi-line input, settings with preset-identical validation, Ctrl-C during a
long generation, /save, history across sessions, and the ways out."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from cli.repl import read_prompt
from tests.conftest import ROOT, STORIES

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
