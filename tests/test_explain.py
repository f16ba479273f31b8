"""`genlab explain`, generate's --logprobs / --color-by / --show-settings through the
CLI, and the --html page in a real headless browser."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.conftest import STORIES

runner = CliRunner()
MODEL = ["-m", str(STORIES)]
SAMPLED = ["-t", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", "-n", "8"]


def run_json(*args: str) -> dict:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def record(stories):
    return run_json("explain", "Once upon a time", *MODEL, *SAMPLED, "--branch", "2:#370")


def test_explain_json_has_every_stage_per_step(record):
    steps = record["original"]["steps"]
    assert len(steps) == 8 and record["sampler"] == "inverse_cdf"
    for step in steps:
        assert [s["name"] for s in step["stages"]] == ["raw", "temperature", "top_k", "top_p"]
        lo, hi = step["interval"]
        assert lo <= step["draw"] * 1.000001 and step["draw"] <= hi + 1e-6  # the draw fell
        assert step["chosen"]["stage_probs"]["top_p"] > 0
        for c in step["candidates"]:
            dropped = c["stage_probs"]["top_p"] == 0
            assert (c["removed_by"] is not None) == dropped
    assert "".join(s["token"] for s in steps) == record["original"]["text"]


def test_explain_branch_keeps_prefix_and_diverges(record):
    original, branch = record["original"], record["branch"]
    assert branch["token_ids"][:2] == original["token_ids"][:2]
    assert branch["token_ids"][2] == 370 and branch["steps"][2]["forced"]
    assert branch["diverges_at"] == (2 if original["token_ids"][2] != 370 else None)
    assert [s["draw"] for s in branch["steps"]] == [s["draw"] for s in original["steps"]]


def test_explain_terminal_view_and_errors(stories):
    result = runner.invoke(app, ["explain", "Once upon a time", *MODEL, *SAMPLED,
                                 "--steps", "1:3", "--branch", "1:#370"])
    assert result.exit_code == 0, result.output
    assert "step 1:" in result.stdout and "step 2:" in result.stdout
    assert "step 0:" not in result.stdout and "step 3:" not in result.stdout
    assert "top_p" in result.stdout and "draw u =" in result.stdout
    assert "diverge" in result.stdout
    bad = runner.invoke(app, ["explain", "Once", *MODEL, "--branch", "x"])
    assert bad.exit_code == 2 and "STEP:TOKEN" in bad.output
    beam = runner.invoke(app, ["explain", "Once", *MODEL, "-s", "beam"])
    assert beam.exit_code == 2 and "beam" in beam.output
    past = runner.invoke(app, ["explain", "Once", *MODEL, "-n", "3", "--branch", "5:#3"])
    assert past.exit_code == 2 and "--max-new-tokens" in past.output


def test_generate_logprobs_json_shape(stories):
    doc = run_json("generate", "Once upon a time", *MODEL, *SAMPLED, "--logprobs", "3")
    out = doc["outputs"][0]  # the JSON contract: per output (docs/output.md)
    content = out["logprobs"]["content"]
    assert len(content) == len(out["token_ids"]) == 8
    for entry, tid in zip(content, out["token_ids"]):
        assert entry["id"] == tid and len(entry["top_logprobs"]) == 3
        assert entry["logprob"] <= 0 and entry["processed_logprob"] <= 0
        raws = [t["logprob"] for t in entry["top_logprobs"]]
        assert raws == sorted(raws, reverse=True)
    assert "".join(e["token"] for e in content) == out["text"]
    plain = run_json("generate", "Once upon a time", *MODEL, *SAMPLED)["outputs"][0]
    assert "logprobs" not in plain and plain["token_ids"] == out["token_ids"]


def test_color_by_is_plain_text_when_piped(stories):
    result = runner.invoke(app, ["generate", "Once upon a time", *MODEL, "-n", "5",
                                 "--color-by", "prob"])
    plain = runner.invoke(app, ["generate", "Once upon a time", *MODEL, "-n", "5"])
    assert result.exit_code == 0 and result.stdout == plain.stdout
    assert "\x1b[" not in result.stdout
    bad = runner.invoke(app, ["generate", "x", *MODEL, "--color-by", "heat"])
    assert bad.exit_code == 2 and "prob, entropy or rank" in bad.output


def test_color_by_styles_follow_the_bins():
    from types import SimpleNamespace

    from cli.render_tokens import PALETTE, style_for

    def detail(p, entropy, rank):
        import math

        return SimpleNamespace(chosen=SimpleNamespace(processed_logprob=math.log(p),
                                                      rank=rank), entropy=entropy)

    assert style_for("prob", detail(0.95, 0, 0)) == PALETTE[0]
    assert style_for("prob", detail(0.01, 0, 0)) == PALETTE[-1]
    assert style_for("entropy", detail(1, 0.1, 0)) == PALETTE[0]
    assert style_for("entropy", detail(1, 5.0, 0)) == PALETTE[-1]
    assert style_for("rank", detail(1, 0, 0)) == PALETTE[0]
    assert style_for("rank", detail(1, 0, 3)) == PALETTE[2]


@pytest.fixture
def model_with_generation_config(tmp_path):
    if not STORIES.is_dir():
        pytest.skip(f"{STORIES} is not present")
    folder = tmp_path / "model"
    folder.mkdir()
    for item in STORIES.iterdir():
        if item.name != "generation_config.json":
            (folder / item.name).symlink_to(item)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [1, 2], "temperature": 0.6, "top_k": 40}))
    return folder


def test_show_settings_names_each_source(model_with_generation_config, tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text("name: mine\ntop_p: 0.8\n")
    result = runner.invoke(app, ["generate", "Once", "-m", str(model_with_generation_config),
                                 "-n", "2", "-t", "0.9", "-p", str(preset),
                                 "--show-settings", "--num-return-sequences", "1"],
                           env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.stderr.splitlines() if line.strip()}
    assert "command line" in lines["temperature"] and "0.6 (not applied)" in lines["temperature"]
    assert "genlab default" in lines["top_k"] and "40 (not applied)" in lines["top_k"]
    assert "preset mine" in lines["top_p"] and "mine.yaml" in lines["top_p"]
    assert "genlab default" in lines["min_p"]
    assert "does not apply a model's generation_config.json" in result.stderr


def test_show_settings_warns_of_ignored_settings(stories, tmp_path):
    from genlib.config import resolve_settings
    from genlib.provenance import sources

    settings = resolve_settings({"strategy": "greedy", "length_penalty": 2.0,
                                 "temperature": 0.5})
    rows = {r.name: r for r in sources(settings, {"strategy": "greedy",
                                                  "length_penalty": 2.0,
                                                  "temperature": 0.5}, None, {})}
    assert "beam search" in rows["length_penalty"].ignored
    assert "sampling" in rows["temperature"].ignored
    assert rows["top_k"].ignored == "" and rows["top_k"].source == "genlab default"


def browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(b)), None)


@pytest.mark.skipif(browser() is None, reason="no headless Chromium installed "
                    "(apt-get install chromium)")
def test_html_page_renders_in_a_browser(record, tmp_path):
    from cli.explain_html import page

    pil = pytest.importorskip("PIL.Image")
    html_file = tmp_path / "explain.html"
    html_file.write_text(page({**record, "model": "stories260K",
                               "settings": {"strategy": "sample", "seed": 3}}))
    url = html_file.as_uri() + "#step-2"
    base = [browser(), "--headless", "--no-sandbox", "--disable-gpu",
            "--window-size=1000,900", "--virtual-time-budget=2000"]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    assert dom.count('class="tok') == len(record["original"]["steps"])
    assert "<h2>step 2:" in dom and "top_p</th>" in dom  # the script ran: step 2's waterfall
    shot = tmp_path / "shot.png"
    subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, timeout=120)
    image = pil.open(shot).convert("L")
    lo, hi = image.getextrema()
    assert hi - lo > 100  # not blank
    colours = pil.open(shot).convert("RGB").getcolors(1 << 20)
    assert colours is not None and len(colours) > 20  # coloured tokens, text, table


def test_explain_runs_the_grammar_first_and_new_stages(tmp_path):
    """With --regex the chain starts with the grammar's mask (the default model, whose
    tokenizer xgrammar compiles for); every candidate the mask removes is marked
    removed_by "grammar", and the text matches the pattern."""
    pytest.importorskip("xgrammar", reason="the grammar extra: pip install 'genlib[grammar]'")
    import re

    record = run_json("explain", "x = ", "--regex", "[0-9]{2}", "-t", "1.5",
                      "--top-n-sigma", "3", "--seed", "1", "-n", "8", "--top", "10")
    original = record["original"]
    assert re.fullmatch("[0-9]{2}", original["text"]) and original["finish_reason"] == "eos"
    for step in original["steps"]:
        assert [s["name"] for s in step["stages"]] == ["raw", "grammar", "temperature",
                                                       "top_n_sigma"]
        assert step["chosen"]["stage_probs"]["grammar"] > 0
        for c in step["candidates"]:
            if c["stage_probs"]["grammar"] == 0:
                assert c["removed_by"] == "grammar"
