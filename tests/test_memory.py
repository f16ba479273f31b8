"""Sizes that cannot fit in memory are refused before any work, in one place
(genlib.models.memory, reached through check_prompts, the batch planner and bench's cases), and
bench builds its prompts in time linear in the batch size."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from genlib.lab import bench
from genlib.models import memory
from tests.conftest import STORIES

runner = CliRunner()
MODEL = ["-m", str(STORIES)]
# stories260K's KV cache in float32: 5 layers x 2 x 4 KV heads x 8 dims x 4 bytes a token
TOKEN_BYTES = 5 * 2 * 4 * 8 * 4


def tail_prompts(lm, length: int, batch_size: int) -> list[list[int]]:
    """The rows as bench defined them before: the head, then the text from token i on,
    cut to the length (quadratic: every row copied the whole rest of the text)."""
    body = lm.encode(bench.FILLER)
    head = [body[0]] if body[0] == lm.tokenizer.bos_token_id else []
    text = body[len(head):]
    need = length - len(head) + batch_size
    text_ids = (text * (need // len(text) + 1))[:need]
    return [(head + text_ids[i:])[:length] for i in range(batch_size)]


def test_bench_prompts_are_the_same_rows_as_before(stories):
    for length, rows in ((1, 4), (2, 3), (9, 50), (130, 7)):
        assert bench.exact_prompts(stories, length, rows) == tail_prompts(stories, length, rows)


def test_bench_builds_100000_rows_in_linear_time(stories):
    """Quadratic, 100,000 rows copy ~5e9 list items (minutes; 40,000 took 3.45 s); a
    window per row copies 1.6 million. The bound leaves room for a loaded machine."""
    start = time.perf_counter()
    prompts = bench.exact_prompts(stories, 16, 100_000)
    took = time.perf_counter() - start
    assert len(prompts) == 100_000 and {len(p) for p in prompts} == {16}
    assert prompts[99_999][1:] == prompts[99_998][2:] + [prompts[99_999][-1]]
    assert took < 5, f"{took:.1f} s for 100,000 rows"


def test_kv_cache_estimate_follows_the_formula(stories, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10 * TOKEN_BYTES * 100)
    memory.check_memory(stories, 10, 90)  # 10 x 90 tokens + logits fits in 10 x 100
    with pytest.raises(memory.TooLargeError) as refused:
        memory.check_memory(stories, 10, 101)
    assert str(refused.value).startswith("10 rows of 101 tokens need about ")
    assert f"but {memory._size(10 * TOKEN_BYTES * 100)} is available on cpu" \
        in str(refused.value)


def test_bench_refuses_a_million_rows_before_building_any_prompt(monkeypatch):
    def no_prompts(*_: object):
        raise AssertionError("prompts were built for a batch that cannot fit")

    monkeypatch.setattr(bench, "exact_prompts", no_prompts)
    start = time.perf_counter()
    result = runner.invoke(app, ["bench", *MODEL, "--batch-size", "1000000"])
    assert result.exit_code == 2, result.output
    cache, logits = 1_000_000 * TOKEN_BYTES * 384, 1_000_000 * 512 * 4
    assert re.fullmatch(
        re.escape(f"error: 1,000,000 rows of 384 tokens need about "
                  f"{memory._size(cache + logits)} of memory (KV cache {memory._size(cache)}, "
                  f"logits {memory._size(logits)}), but ") + r"[0-9.,]+ [KMGT]iB" +
        re.escape(" is available on cpu; lower --batch-size, --prompt-len or --new-tokens"),
        result.stderr.strip()), result.stderr
    assert time.perf_counter() - start < 120  # the model's load, on a busy machine


@pytest.fixture
def little_memory(monkeypatch):
    """As if the machine had room for 4 rows of stories260K's 512 positions."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 4 * 512 * TOKEN_BYTES)


@pytest.mark.parametrize(("args", "rows"), [
    (["generate", "Once upon a time", "-t", "0.8", "--num-return-sequences", "8"], 8),
    (["beam", "Once upon a time", "--num-beams", "8"], 8),
])
def test_rows_that_cannot_fit_are_refused_in_every_command(little_memory, args, rows):
    result = runner.invoke(app, [args[0], *MODEL, "-n", "500", *args[1:]])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {rows} rows of ")
    assert "need about" in result.stderr and "is available on cpu" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not result.stdout


def test_compare_names_the_strategy_that_cannot_fit(little_memory):
    result = runner.invoke(app, ["compare", "Once upon a time", *MODEL, "-n", "500",
                                 "--variant", "num_beams=8", "--variant", "top_k=5"])
    assert result.exit_code == 0, result.output  # the strategy that fits still runs
    assert "warning: num_beams=8: 8 rows of 505 tokens need about " in result.stderr
    assert "top_k=5" in result.stdout


def test_one_row_that_fits_still_runs(little_memory):
    result = runner.invoke(app, ["generate", "Once upon a time", *MODEL, "-n", "8"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_a_batch_that_cannot_fit_is_refused_before_any_line_runs(little_memory,
                                                                 tmp_path: Path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": "Once upon a time"}) + "\n"
                           for i in range(8)))
    result = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output",
                                 str(out), "-n", "500", "--batch-size", "8"])
    assert result.exit_code == 2, result.output
    assert "error: 8 rows of " in result.stderr
    assert "lower --batch-size, or the lines' max_new_tokens" in result.stderr
    assert out.read_text() == ""  # not one line generated, nor an error record per line
    fits = runner.invoke(app, ["generate", *MODEL, "--input", str(src), "--output", str(out),
                               "-n", "8", "--batch-size", "2"])
    assert fits.exit_code == 0, fits.output
