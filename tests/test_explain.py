"""`genlab explain`, generate's --logprobs / --color-by / --show-settings through the
CLI, and the --html page in a real headless browser."""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.conftest import ROOT, SHARED_MODELS, STORIES

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


def explain_steps(*args: str) -> tuple[int, int]:
    """(steps explained, the max_new_tokens the record says it ran with)."""
    record = run_json("explain", "Once upon a time", *MODEL, "--ignore-eos", *args)
    return len(record["original"]["steps"]), record["settings"]["max_new_tokens"]


def test_explain_max_new_tokens_is_flag_then_preset_then_20(stories, tmp_path):
    preset = tmp_path / "seven.yaml"
    preset.write_text("name: seven\nmax_new_tokens: 7\n")
    assert explain_steps() == (20, 20)
    assert explain_steps("-p", str(preset)) == (7, 7)
    assert explain_steps("-p", str(preset), "-n", "5") == (5, 5)


def test_explain_truncates_the_prompt_as_generate_does():
    """--truncate-prompt, as generate, beam and speculate take it: the same last tokens,
    so the same greedy tokens as generate's (without it, the error names the flag)."""
    llama2xs = SHARED_MODELS / "llama2xs"  # 256 positions
    if not llama2xs.is_dir():
        pytest.skip("llama2xs not present")
    prompt = "Once upon a time there was a dog. " * 60  # about 600 tokens
    args = [prompt, "-m", str(llama2xs), "-n", "4", "--truncate-prompt"]
    explained = run_json("explain", *args)
    generated = run_json("generate", *args)
    assert explained["prompt_tokens"] == generated["prompt_tokens"] == 256 - 4
    assert explained["original"]["token_ids"] == generated["outputs"][0]["token_ids"]
    refused = runner.invoke(app, ["explain", *args[:-1]])
    assert refused.exit_code == 2
    assert "explain take --truncate-prompt" in refused.stderr


def test_explain_takes_quantize_as_generate_does():
    """explain loaded every model unquantized, whatever the user ran generate with."""
    def logprobs(command: str, *quantize: str) -> list[float]:
        args = ["Once upon a time", *MODEL, "-n", "4", *quantize]
        if command == "explain":
            return [s["chosen"]["logprob"] for s in run_json(command, *args)["original"]["steps"]]
        doc = run_json(command, *args, "--logprobs", "1")
        return [t["logprob"] for t in doc["outputs"][0]["logprobs"]["content"]]

    quantized = logprobs("explain", "--quantize", "8bit")
    assert quantized == pytest.approx(logprobs("generate", "--quantize", "8bit"), abs=1e-5)
    assert quantized != pytest.approx(logprobs("explain"), abs=1e-5)


def test_explain_steps_past_the_run_warn_and_json_refuses_steps(stories):
    result = runner.invoke(app, ["explain", "Once upon a time", *MODEL, "-n", "3",
                                 "--steps", "5:8"])
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.strip() == \
        "warning: --steps 5:8 selects no step: the run has 3 steps (0-2)"
    inside = runner.invoke(app, ["explain", "Once upon a time", *MODEL, "-n", "3",
                                 "--steps", "2:8"])
    assert "step 2:" in inside.stdout and "warning" not in inside.stderr
    with_json = runner.invoke(app, ["explain", "Once", *MODEL, "--steps", "1:2", "--json"])
    assert with_json.exit_code == 2 and with_json.stdout == ""
    assert "--json writes every step" in with_json.stderr


def test_forcing_the_chosen_token_says_there_is_no_divergence(record):
    chosen = record["original"]["token_ids"][4]
    result = runner.invoke(app, ["explain", "Once upon a time", *MODEL, *SAMPLED,
                                 "--steps", "4", "--branch", f"4:#{chosen}"])
    assert result.exit_code == 0, result.output
    assert "no divergence: the token forced at step 4 is the one the original chose " \
           "there, so the two runs are the same" in result.stdout
    assert "(marked)" not in result.stdout
    moved = runner.invoke(app, ["explain", "Once upon a time", *MODEL, *SAMPLED,
                                "--steps", "4", "--branch", "4:#370"])
    assert "they diverge at step 4 (marked)" in moved.stdout
    ended = runner.invoke(app, ["explain", "Once upon a time", *MODEL, "--stop", " was",
                                "--steps", "0", "--branch", "5:#370"])
    assert ended.exit_code == 0, ended.output
    assert "no divergence: the run ended after 3 steps, before step 5, so nothing was " \
           "forced and the two runs are the same" in ended.stdout


def test_json_entropy_of_a_one_token_stage_is_plus_zero(record):
    entropies = [stage["entropy"] for step in record["original"]["steps"]
                 for stage in step["stages"]]
    assert 0.0 in entropies  # top-p kept one token at some step
    assert all(math.copysign(1, e) == 1 for e in entropies)


def help_examples(command: str) -> list[list[str]]:
    """The command lines under "Examples:" in a command's --help."""
    text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "250"}).stdout
    return [shlex.split(line.strip(" │"))[1:] for line in text.splitlines()
            if line.strip(" │").startswith(f"genlab {command} ")]


def test_explains_help_examples_run(tmp_path, monkeypatch):
    """Each example in `genlab explain --help` runs (the default model; --branch's TOKEN
    is one token of it)."""
    examples = help_examples("explain")
    assert len(examples) == 3 and any("--branch" in e for e in examples)
    monkeypatch.chdir(tmp_path)  # --html explain.html is written here
    for example in examples:
        result = runner.invoke(app, example)
        assert result.exit_code == 0, (example, result.output)
    assert (tmp_path / "explain.html").is_file()


def test_the_explain_outputs_in_the_docs_are_real(stories):
    """Every `$ genlab explain ...` block in docs/explain.md prints what it shows."""
    page = (ROOT / "docs" / "explain.md").read_text()
    blocks = re.findall(r"```\n\$ genlab (explain .*?)\n(.*?)```", page, re.S)
    assert len(blocks) == 2
    for command, shown in blocks:
        args = shlex.split(command.replace("../shared/models/", f"{SHARED_MODELS}/"))
        result = runner.invoke(app, args, env={"COLUMNS": "120"})
        assert result.exit_code == 0, result.output
        printed = "\n".join(line.rstrip() for line in result.stdout.splitlines())
        assert printed.strip("\n") == shown.strip("\n"), command


class Spans(HTMLParser):
    """The token spans of an --html page: (run, step, classes, text), and the others'
    text (tokens outside --steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[list] = []
        self.skipped: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "span" and "tok" in classes:
            self.tokens.append([a["data-run"], int(a["data-step"]), set(classes), ""])
            self._in = "tok"
        elif tag == "span" and "skip" in classes:
            self.skipped.append("")
            self._in = "skip"

    def handle_data(self, data: str) -> None:
        if self._in == "tok":
            self.tokens[-1][3] += data
        elif self._in == "skip":
            self.skipped[-1] += data

    def handle_endtag(self, tag: str) -> None:
        self._in = None


def html_page(tmp_path, *args: str) -> tuple[Spans, dict, str]:
    """Run explain --html; the page's spans, its STEPS data and the page."""
    html_file = tmp_path / "explain.html"
    result = runner.invoke(app, ["explain", "Once upon a time", *MODEL, *SAMPLED, *args,
                                 "--html", str(html_file)])
    assert result.exit_code == 0, result.output
    page = html_file.read_text()
    spans = Spans()
    spans.feed(page)
    data = json.loads(re.search(r"const STEPS = (.*?);  //", page).group(1))
    return spans, data, page


def test_html_page_shows_the_branch(record, tmp_path):
    spans, data, page = html_page(tmp_path, "--branch", "2:#370")
    original, branch = record["original"], record["branch"]
    at = branch["diverges_at"]
    assert at == 2
    for name, run in (("original", original), ("branch", branch)):
        mine = [t for t in spans.tokens if t[0] == name]
        assert [t[1] for t in mine] == list(range(len(run["steps"])))
        assert "".join(t[3] for t in mine) == run["text"]
        assert [t[1] for t in mine if "diverged" in t[2]] == list(range(at, len(mine)))
        assert [t[1] for t in mine if "forced" in t[2]] == ([2] if name == "branch" else [])
        assert [s["chosen"]["id"] for s in data[name].values()] == run["token_ids"]
    assert data["branch"]["2"]["forced"] and not data["original"]["2"]["forced"]
    assert "The branch forced &#x27; big&#x27; at step 2" in page
    assert "the runs diverge at step 2" in page
    same = tmp_path / "same"
    same.mkdir()
    chosen = original["token_ids"][2]
    spans, _, page = html_page(same, "--branch", f"2:#{chosen}")
    assert not any("diverged" in t[2] for t in spans.tokens)
    assert [t[:2] for t in spans.tokens if "forced" in t[2]] == [["branch", 2]]
    assert "the token the original chose there: no divergence, the two runs are the " \
           "same" in page
    ended = tmp_path / "ended"
    ended.mkdir()
    spans, _, page = html_page(ended, "--stop", " was", "--branch", "7:#370")
    assert len(spans.tokens) == 2 * len(record["original"]["steps"][:3])
    assert "The run ended after 3 steps, before step 7: the branch forced nothing" in page


def test_html_page_honours_steps(record, tmp_path):
    spans, data, page = html_page(tmp_path, "--steps", "2:4")
    steps = record["original"]["steps"]
    assert [t[1] for t in spans.tokens] == [2, 3] and list(data["original"]) == ["2", "3"]
    assert spans.skipped == [s["token"] for s in steps if s["step"] not in (2, 3)]
    assert "Only steps 2 to 3 (--steps) can be clicked" in page


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
    assert bad.exit_code == 2 and (
        "--color-by must be one of prob, entropy, rank, got 'heat'") in bad.output


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
    from genlib.settings.config import resolve_settings
    from genlib.settings.provenance import sources

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
    assert dom.count('class="tok') == len(record["original"]["steps"]) + \
        len(record["branch"]["steps"])
    assert "<h2>original, step 2:" in dom and "top_p</th>" in dom  # the script ran
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


@pytest.mark.parametrize("branch,message", [
    ("x", "error: --branch 'x': give STEP:TOKEN, e.g. 3:#421 (a token id) or \"3: the\" (a "
          "text that is one token of the model)"),
    ("9:the", "error: --branch step 9 is past --max-new-tokens (4); steps count from 0"),
])
def test_a_bad_branch_point_is_one_line(branch, message):
    """--branch and the interactive /branch read a branch point with one function."""
    result = runner.invoke(app, ["explain", "Once", *MODEL, "-n", "4", "--branch", branch])
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == message


def page_with_tokens(record: dict, tokens: dict[int, str], candidates: dict[int, str]) -> str:
    """The --html page of `record` with the chosen token of some steps and the second
    candidate of others replaced by the given texts."""
    from cli.explain_html import page

    changed = copy.deepcopy(record)
    steps = changed["original"]["steps"]
    for i, text in tokens.items():
        steps[i]["token"] = text
    for i, text in candidates.items():
        steps[i]["candidates"][1]["token"] = text
    return page(changed)


MARKUP = {1: "<!--", 3: "<script>", 5: "</script><b>&amp;"}


def test_html_page_script_holds_no_markup_from_token_texts(record):
    """A token's text inside the page's data can neither end its script nor, with
    `<!--` and `<script`, keep the page's own `</script>` from ending it."""
    page = page_with_tokens(record, {}, MARKUP)
    assert page.split("<script>", 1)[1].count("</script>") == 1
    data = re.search(r"const STEPS = (.*?);  //", page).group(1)
    assert "<" not in data and ">" not in data and "&" not in data
    steps = json.loads(data)["original"]
    assert {i: steps[str(i)]["candidates"][1]["token"] for i in MARKUP} == MARKUP


def test_html_page_marks_line_breaks_and_pending_bytes(record, tmp_path):
    """A token that is only a line break, or has no text yet (a byte piece), is drawn
    with a mark, so it can be seen and clicked; other tokens are not marked."""
    page = page_with_tokens(record, {2: "\n", 4: "", 6: "\n    "}, {})
    spans = Spans()
    spans.feed(page)
    marks = {t[1]: t[2] & {"newline", "empty"} for t in spans.tokens if t[0] == "original"}
    assert marks == {i: {2: {"newline"}, 4: {"empty"}, 6: {"newline"}}.get(i, set())
                     for i in range(len(record["original"]["steps"]))}
    assert re.search(r"\.tok\.newline::before \{ content: \"\\21B5\"", page)
    assert re.search(r"\.tok\.empty::before \{ content: \"\\00B7\"", page)


@pytest.mark.skipif(browser() is None, reason="no headless Chromium installed "
                    "(apt-get install chromium)")
def test_html_page_with_markup_in_token_texts_runs_in_a_browser(record, tmp_path):
    """The page whose data holds `<!--`, `<script>` and `</script>` still runs its
    script: opening it at #step-2 shows step 2."""
    html_file = tmp_path / "explain.html"
    html_file.write_text(page_with_tokens(record, {}, MARKUP))
    dom = subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu",
                          "--virtual-time-budget=2000", "--dump-dom",
                          html_file.as_uri() + "#step-2"],
                         capture_output=True, text=True, timeout=120).stdout
    assert "<h2>original, step 2:" in dom


def test_a_small_probability_a_stage_kept_is_not_written_as_zero(stories):
    """At temperature 0.3 the raw model's 3rd to 6th tokens keep probabilities far below
    1e-6: the record and the view give them, not the 0 of a removed token."""
    args = ["explain", "Once upon a time", *MODEL, "-t", "0.3", "--seed", "1", "-n", "1",
            "--top", "6"]
    step = run_json(*args)["original"]["steps"][0]
    kept = [c for c in step["candidates"] if c["removed_by"] is None]
    assert len(kept) == 6 and min(c["stage_probs"]["temperature"] for c in kept) < 1e-6
    assert all(p > 0 for c in kept for p in c["stage_probs"].values())
    view = runner.invoke(app, args, env={"COLUMNS": "120"}).stdout
    rows = [line.split("│") for line in view.splitlines() if line.startswith(" '")]
    assert len(rows) == 6 and all(cell.strip() != "0" for row in rows for cell in row)


def builtin_token_id(token: str) -> int:
    """The built-in model's id for `token`."""
    from transformers import AutoTokenizer

    from genlib.models.loading import BUILTIN_MODELS

    folder = BUILTIN_MODELS["builtin:code-small"]
    return AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(token)


def test_a_branch_token_the_grammar_forbids_is_refused(tmp_path):
    """Forcing a token the grammar does not allow would leave it no next token (the
    record's probabilities NaN, the branch ended by a token drawn from nothing): one
    line saying so, exit 2, no output; a token it allows branches as usual."""
    pytest.importorskip("xgrammar", reason="the grammar extra: pip install 'genlib[grammar]'")
    args = ["explain", "x = ", "--regex", "[0-9]{2}", "-t", "1.5", "--seed", "1", "-n", "4"]
    page = tmp_path / "explain.html"
    result = runner.invoke(app, [*args, "--branch", "0:a", "--json", "--html", str(page)])
    assert result.exit_code == 2 and result.stdout == "" and not page.exists()
    a = builtin_token_id("a")
    assert " ".join(result.stderr.split()) == (
        f"error: the branch's token 'a' (id {a}) is not allowed by the grammar at step 0; "
        "force one it allows there (a candidate whose grammar probability is above 0)")
    branch = run_json(*args, "--branch", f"0:#{builtin_token_id('7')}")["branch"]
    assert re.fullmatch("7[0-9]", branch["text"]) and branch["finish_reason"] == "eos"


def test_the_step_view_keeps_every_number_whole_at_80_columns(stories):
    """A chain of eight stages is wider than 80 columns: the step is shown as several
    tables of consecutive stages, no line wider than the terminal, no number cut."""
    from cli.render_explain import _pct

    args = ["explain", "Once upon a time", *MODEL, "-t", "0.8", "--top-k", "20",
            "--top-p", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.3",
            "--typical-p", "0.9", "--min-new-tokens", "3", "--seed", "1", "-n", "3"]
    step = run_json(*args)["original"]["steps"][2]
    assert len(step["stages"]) == 8
    view = runner.invoke(app, [*args, "--steps", "2"], env={"COLUMNS": "80"}).stdout
    table = [line for line in view.splitlines() if not line.startswith("draw u =")]
    assert max(len(line) for line in table) <= 80 and "…" not in view
    cells = {cell.strip() for line in view.splitlines() for cell in re.split("[│┃]", line)}
    assert {s["name"] for s in step["stages"]} <= cells
    assert {_pct(p) for c in step["candidates"] for p in c["stage_probs"].values()} <= cells
    assert view.count("step 2: chose") == 1 and view.count("draw u =") == 1
