"""genlib.lab.compare and `genlab compare`: strategy sets, the runs on stories260K, what the
seed notes predict about repetition, the live view's layouts and the exports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.compare import View, comparison_markdown, metric_cell
from cli.main import app
from genlib.errors import ConfigError
from genlib.events import Finish
from genlib.generate import stream
from genlib.lab import compare as cmp
from genlib.lab import metrics

SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
STORIES = SHARED_MODELS / "stories260K"
LLAMA2XS = SHARED_MODELS / "llama2xs"
CODE_TARGET = SHARED_MODELS / "code-target"

PROMPT = "Once upon a time"
GREEDY_START = ", there was a little girl named Lily."
DEFAULT_LABELS = [label for label, _ in cmp.DEFAULT_STRATEGIES]


# --- building strategies (no model) -------------------------------------------------

def test_default_set():
    strategies = {s.label: s.settings for s in cmp.build_strategies([], [], {})}
    assert list(strategies) == DEFAULT_LABELS
    assert strategies["greedy"].strategy == "greedy"
    assert (strategies["beam"].strategy, strategies["beam"].num_beams) == ("beam", 4)
    assert strategies["beam"].no_repeat_ngram_size == 0  # plain beam: its loops must show
    assert (strategies["top-k"].do_sample, strategies["top-k"].top_k) == (True, 40)
    assert strategies["top-p"].top_p == 0.9
    assert strategies["temp 0.5"].temperature == 0.5
    assert strategies["temp 1.3"].temperature == 1.3


def test_presets_and_variants_in_order_with_common_flags():
    strategies = cmp.build_strategies(["beam", "creative"], ["temperature=0.7, top_p=0.8"],
                                      {"max_new_tokens": 10})
    assert [s.label for s in strategies] == ["beam", "creative", "temperature=0.7, top_p=0.8"]
    assert all(s.settings.max_new_tokens == 10 for s in strategies)  # flag > preset's 64
    assert strategies[0].settings.no_repeat_ngram_size == 3  # the rest of the preset stays
    variant = strategies[2].settings
    assert (variant.strategy, variant.temperature, variant.top_p) == ("sample", 0.7, 0.8)


def test_variant_wins_over_common_flags():
    [s] = cmp.build_strategies([], ["max_new_tokens=5"], {"max_new_tokens": 10})
    assert s.settings.max_new_tokens == 5


def test_samples_only_for_stochastic_strategies():
    strategies = {s.label: s.settings for s in cmp.build_strategies([], [], {}, samples=3)}
    assert strategies["greedy"].num_return_sequences == 1
    assert strategies["beam"].num_return_sequences == 1
    assert strategies["top-p"].num_return_sequences == 3


@pytest.mark.parametrize(("variants", "message"), [
    (["temperature"], "expected KEY=VALUE"),
    (["top_q=0.9"], "did you mean 'top_p'"),
    (["top_p=0.9", "top_p=0.9"], "given twice"),
])
def test_bad_strategies_are_rejected(variants, message):
    with pytest.raises(ConfigError, match=message):
        cmp.build_strategies([], variants, {})


@pytest.mark.parametrize("variants", [[], ["top_k=5"]])
def test_a_bad_common_flag_is_the_command_lines_error(variants):
    """-n 0 is blamed on the command line, not on a column: the default set's first
    (`--variant 'strategy=greedy'`, which nobody wrote) or the user's variant."""
    with pytest.raises(ConfigError, match=r"^command line: max_new_tokens must be >= 1"):
        cmp.build_strategies([], variants, {"max_new_tokens": 0})


def test_too_many_samples_name_the_samples_flag():
    with pytest.raises(ConfigError, match=r"^--samples: num_return_sequences must be .*2000"):
        cmp.build_strategies([], ["top_k=5"], {}, samples=2000)


def test_samples_beyond_a_beam_sampling_columns_beams_name_the_flag_and_column():
    """It said only "num_return_sequences (3) must be <= num_beams (2)", a setting the
    user never wrote, in none of several columns."""
    variant = "strategy=beam,num_beams=2,do_sample=true"
    with pytest.raises(ConfigError, match=r"^--samples 3 does not fit strategy "
                       r"'strategy=beam,num_beams=2,do_sample=true': num_return_sequences "
                       r"\(3\) must be <= num_beams \(2\)$"):
        cmp.build_strategies([], ["top_k=5", variant], {}, samples=3)


def test_column_headers_name_only_the_settings_that_changed():
    greedy, creative, top_k = cmp.build_strategies(["greedy", "creative"], ["top_k=5"], {})
    biased = cmp.Strategy("biased", greedy.settings.replace(logit_bias={"5": 2.0}), "variant")
    view = View([greedy, creative, top_k, biased], PROMPT)
    assert [view.header(i) for i in range(4)] == [
        "[bold]greedy[/]",  # the empty default logit_bias is no change
        "[bold]creative[/]\n[dim]sample temperature=0.9 top_p=0.92[/]",
        "[bold]top_k=5[/]\n[dim]sample top_k=5[/]",
        "[bold]biased[/]\n[dim]greedy logit_bias={'5': 2.0}[/]",
    ]


def test_sample_seeds_derive_from_base():
    from genlib.settings.config import derive_seed

    assert cmp.sample_seeds(7, 3) == [7, derive_seed(7, 1), derive_seed(7, 2)]


# --- running on stories260K ---------------------------------------------------------

@pytest.fixture(scope="module")
def default_run(stories):
    strategies = cmp.sharing_seed(
        cmp.build_strategies([], [], {"max_new_tokens": 12}, samples=2), 5)
    return cmp.compare(stories, stories.encode(PROMPT), strategies, prompt=PROMPT, seed=5)


def test_one_untimed_token_comes_before_the_first_strategys_clock(stories, monkeypatch):
    """The process's first forward (the weights' first reads, the backend's first call)
    was billed to the first column's time and tokens/s."""
    import genlib.generate

    calls = []

    def recording(lm, prompts, settings, **kwargs):
        calls.append((settings.strategy, settings.max_new_tokens))
        yield from stream(lm, prompts, settings, **kwargs)

    monkeypatch.setattr(genlib.generate, "stream", recording)
    strategies = cmp.sharing_seed(
        cmp.build_strategies(["greedy"], ["top_k=5"], {"max_new_tokens": 6}), 1)
    result = cmp.compare(stories, stories.encode(PROMPT), strategies, prompt=PROMPT, seed=1)
    assert calls == [("greedy", 1), ("greedy", 6), ("sample", 6)]
    assert [len(r.samples[0].token_ids) for r in result.results] == [6, 6]  # none counted


def test_every_strategy_has_a_column(default_run):
    assert [r.strategy.label for r in default_run.results] == DEFAULT_LABELS
    by_label = {r.strategy.label: r for r in default_run.results}
    assert by_label["greedy"].samples[0].text.startswith(GREEDY_START[:30])
    for label in ("top-k", "top-p", "temp 0.5", "temp 1.3"):
        result = by_label[label]
        assert result.error is None and len(result.samples) == 2
        assert all(len(s.token_ids) == 12 for s in result.samples)
        assert result.metrics["diversity"] is not None


def test_beam_column_is_real_beam_search(default_run, stories):
    from genlib.decoding.beam import beam_search

    beam = next(r for r in default_run.results if r.strategy.label == "beam")
    assert beam.error is None and len(beam.samples) == 1
    [result] = beam_search(stories, [stories.encode(PROMPT)], beam.strategy.settings)
    assert list(beam.samples[0].token_ids) == list(result.hypotheses[0].token_ids)


def test_metrics_are_those_of_the_samples(default_run):
    top_p = next(r for r in default_run.results if r.strategy.label == "top-p")
    ids = [s.token_ids for s in top_p.samples]
    expected = metrics.sample_set_metrics(ids, [s.logprobs for s in top_p.samples])
    for key, value in expected.items():
        assert top_p.metrics[key] == pytest.approx(value)
    assert top_p.metrics["perplexity"] == pytest.approx(
        sum(math.exp(-sum(s.logprobs) / len(s.logprobs)) for s in top_p.samples) / 2)
    assert top_p.metrics["tokens_per_s"] == pytest.approx(24 / top_p.metrics["seconds"])


def test_samples_reproduce_generate_with_the_same_seed(stories, default_run):
    """With common random numbers (compare's default) a sample is the generation with
    the same seed drawn by inverse CDF; with --no-crn, plain `generate`'s."""
    from genlib.decoding.detail import Detail
    from genlib.generate import generate

    top_k = next(r for r in default_run.results if r.strategy.label == "top-k")
    settings = top_k.strategy.settings
    seeds = cmp.sample_seeds(5, 2)
    finishes = [e for e in stream(stories, [stories.encode(PROMPT)], settings, seeds=seeds,
                                  detail=Detail(record=False, inverse_cdf=True))
                if isinstance(e, Finish)]
    assert [f.token_ids for f in sorted(finishes, key=lambda f: f.row)] == \
        [s.token_ids for s in top_k.samples]
    independent = cmp.compare(stories, stories.encode(PROMPT), [top_k.strategy], seed=5,
                              crn=False)
    finishes = generate(stories, [stories.encode(PROMPT)], settings)
    assert [f.token_ids for f in finishes] == \
        [s.token_ids for s in independent.results[0].samples]


@pytest.mark.slow
def test_greedy_repeats_more_than_top_p_in_a_long_story(stories):
    """The seed notes: greedy repeats itself in open-ended text; nucleus sampling does
    not. 200 tokens of story (greedy loops after ~120), top-p averaged over 2 samples."""
    strategies = cmp.sharing_seed(cmp.build_strategies(
        [], ["strategy=greedy", "top_p=0.9"], {"max_new_tokens": 200, "ignore_eos": True},
        samples=2), 0)
    greedy, top_p = cmp.compare(stories, stories.encode(PROMPT), strategies).results
    assert greedy.metrics["new_tokens"] == top_p.metrics["new_tokens"] == 200
    assert greedy.metrics["repeated_4gram"] > 0.1
    assert greedy.metrics["repeated_4gram"] > 3 * top_p.metrics["repeated_4gram"]
    assert greedy.metrics["perplexity"] < top_p.metrics["perplexity"]


def test_model_comparison_divergence(tmp_path):
    from genlib.models.loading import ModelSpec

    if not (STORIES.is_dir() and LLAMA2XS.is_dir()):
        pytest.skip("shared models missing")
    [greedy] = cmp.build_strategies([], ["strategy=greedy"], {"max_new_tokens": 30})
    specs = [ModelSpec(str(STORIES)), ModelSpec(str(STORIES)), ModelSpec(str(LLAMA2XS))]
    same, again, other = cmp.compare_models(specs, PROMPT, greedy).runs
    assert same.first_difference is None and same.agreement == 1.0
    assert again.first_difference is None and again.token_ids == same.token_ids
    assert other.unit == "token"  # same tokenizer: compared token by token
    expected_first = metrics.first_difference(same.token_ids, other.token_ids)
    assert other.first_difference == expected_first is not None
    assert other.agreement == pytest.approx(metrics.agreement(same.token_ids, other.token_ids))
    assert other.agreement < 1.0 and other.weight_bytes > 0


def test_a_model_run_reports_its_weights_without_loading_transformers_model(monkeypatch):
    from genlib.models import loading
    from genlib.models.loading import ModelSpec

    if not CODE_TARGET.is_dir():
        pytest.skip("shared models missing")
    loaded = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loaded.append(real(*a, **k))
                        or loaded[-1])
    [greedy] = cmp.build_strategies([], ["strategy=greedy"], {"max_new_tokens": 4})
    [run] = cmp.compare_models([ModelSpec(str(CODE_TARGET))], PROMPT, greedy).runs
    assert len(loaded) == 1 and not loaded[0].model_loaded  # the quick load alone
    model = real(ModelSpec(str(CODE_TARGET))).model
    matrices = {p.data_ptr(): p.numel() * 4 for p in model.parameters() if p.dim() == 2}
    assert run.weight_bytes == sum(matrices.values())  # the native kernel's: every matrix


def test_each_model_run_times_its_generation_only(monkeypatch):
    """The first run's tokens/s carried the process's first forward (3-10 times below the
    same model's next run) and, after the generation, the logprobs object's bookkeeping:
    each run now gets an untimed token first and is timed by the decoder's clock."""
    import genlib.generate
    from genlib.models.loading import ModelSpec

    if not STORIES.is_dir():
        pytest.skip("shared models missing")
    calls = []

    def recording(lm, prompts, settings, **kwargs):
        calls.append(settings.max_new_tokens)
        yield from stream(lm, prompts, settings, **kwargs)

    def slow_bookkeeping(lm, recorded):
        import time

        time.sleep(0.5)
        return {}

    monkeypatch.setattr(genlib.generate, "stream", recording)
    monkeypatch.setattr(cmp, "logprobs_objects", slow_bookkeeping)
    [greedy] = cmp.build_strategies([], ["strategy=greedy"], {"max_new_tokens": 6})
    runs = cmp.compare_models([ModelSpec(str(STORIES))] * 2, PROMPT, greedy).runs
    assert calls == [1, 6, 1, 6]  # an untimed token before each timed run
    assert all(r.seconds < 0.5 and len(r.token_ids) == 6 for r in runs)


def test_ctrl_c_stops_the_model_comparison_after_the_cut_run(ctrl_c_at):
    from genlib.models.loading import ModelSpec

    if not STORIES.is_dir():
        pytest.skip("shared models missing")
    [greedy] = cmp.build_strategies([], ["strategy=greedy"], {"max_new_tokens": 30})
    ctrl_c_at(29 + 5)  # the 5th step of the second run (30 tokens take 29 steps)
    comparison = cmp.compare_models([ModelSpec(str(STORIES))] * 3, PROMPT, greedy)
    assert comparison.interrupted
    first, cut = comparison.runs  # the third never ran
    assert first.finish_reason == "length" and len(first.token_ids) == 30
    assert cut.finish_reason == "interrupted" and len(cut.token_ids) == 5


def test_ctrl_c_stops_the_strategy_comparison(stories, ctrl_c_at):
    greedy, beam = cmp.build_strategies(["greedy", "beam"], [], {"max_new_tokens": 12})
    ctrl_c_at(11 + 3)  # the 3rd step of the second strategy (12 greedy tokens: 11 steps)
    comparison = cmp.compare(stories, stories.encode(PROMPT), [greedy, beam, greedy])
    seen = comparison.results
    assert [r.strategy.label for r in seen] == ["greedy", "beam"]  # not the third
    assert not seen[0].interrupted and seen[1].interrupted and comparison.interrupted


# --- the view -----------------------------------------------------------------------

def _render(renderable, width: int) -> str:
    from rich.console import Console

    console = Console(width=width, record=True, force_terminal=False)
    console.print(renderable)
    return console.export_text()


def test_wide_terminal_columns_narrow_terminal_stacks(default_run):
    strategies = [r.strategy for r in default_run.results]
    view = View(strategies, PROMPT)
    for index, result in enumerate(default_run.results):
        view.on_event(index, cmp.StrategyDone(result))
    wide = _render(view.render(250), 250)
    header = wide[:wide.index("output")]  # the header rows, above the first text row
    assert all(label in header for label in DEFAULT_LABELS)
    assert "prompt: Once upon a time" in wide
    narrow = _render(view.render(80), 80)
    starts = [narrow.index(label) for label in ("greedy", "top-k", "temp 1.3")]
    assert starts == sorted(starts)  # one panel after another
    panels = narrow[:narrow.index("* the best value")]  # the legend below names metrics too
    assert panels.count("repeated 4-grams") == len(strategies) - \
        sum(r.error is not None for r in default_run.results)


def test_best_metric_is_highlighted():
    best = {"perplexity": 1.5}
    assert metric_cell("perplexity", 1.5, best) == "[bold green]1.50 *[/]"
    assert metric_cell("perplexity", 2.0, best) == "2.00"


def result_with_counts(*counts: int) -> cmp.StrategyResult:
    [top_k] = cmp.build_strategies(["topk"], [], {}, samples=len(counts))
    samples = [cmp.Sample("x", (1,) * n, (-1.0,) * n, "length", 0.1) for n in counts]
    return cmp.StrategyResult(top_k, samples, {"new_tokens": sum(counts) / len(counts)})


def test_new_tokens_is_an_integer_unless_the_samples_differ():
    from cli.compare import metric_text

    assert metric_text(result_with_counts(48, 48), "new_tokens") == "48"
    assert metric_text(result_with_counts(47, 49), "new_tokens") == "48.0"  # a mean
    assert metric_text(result_with_counts(47, 48), "new_tokens") == "47.5"


def view_of(run: cmp.Comparison) -> View:
    view = View([r.strategy for r in run.results], PROMPT)
    for index, result in enumerate(run.results):
        view.on_event(index, cmp.StrategyDone(result))
    return view


def test_the_view_says_what_the_star_means(default_run):
    for width in (80, 160):
        text = " ".join(_render(view_of(default_run).render(width), width)
                        .replace("│", " ").split())
        assert "*" in text.replace("* the best value", "")  # a star to explain
        assert ("* the best value of its row, among the strategies that ran to the end: "
                "highest tokens/s, mean logprob, distinct-1") in text
        assert "lowest time (s), perplexity, repeated 4-grams" in text
        assert "new tokens 12 " in text and "12.0" not in text  # every sample has 12
    waiting = View([r.strategy for r in default_run.results], PROMPT)
    assert "the best value" not in _render(waiting.render(160), 160)  # no metrics: no legend


def test_wide_terminal_puts_strategies_side_by_side_in_rows(default_run):
    """Six strategies at 160 columns: two rows of three columns; at 80 (and in a pipe,
    whatever the width) one panel after another; every word of every text shown."""
    view = view_of(default_run)
    labels = [r.strategy.label for r in default_run.results]
    wide = _render(view.render(160), 160)
    lines = wide.splitlines()
    assert any(all(label in line for label in labels[:3]) for line in lines), wide
    assert any(all(label in line for label in labels[3:]) for line in lines), wide
    assert sum("│ output" in line for line in lines) == 2  # two tables of three
    assert not any(labels[0] in line and labels[3] in line for line in lines)
    for narrow in (_render(view.render(80), 80), _render(view.render(160, terminal=False), 160)):
        assert not any(sum(label in line for label in ("greedy", "top-k", "top-p")) > 1
                       for line in narrow.splitlines())
        starts = [narrow.index(label) for label in labels]
        assert starts == sorted(starts)  # one panel after another
    flat = " ".join(wide.replace("│", " ").split())
    for result in default_run.results:
        for sample in result.samples:
            assert all(word in flat.split() for word in sample.text.split()), sample.text


def test_markdown_has_every_strategy(default_run):
    text = comparison_markdown(default_run)
    for label in DEFAULT_LABELS:
        assert f"\n## {label}\n" in text
    assert "| repeated 4-grams |" in text and "**" in text


def test_markdown_code_blocks_hold_texts_that_write_backticks():
    """A sample (or model run) that writes ``` closed its ```text block early: the rest
    of the text, and every section after it, read as Markdown instead of as output."""
    from markdown_it import MarkdownIt

    from cli.compare import models_markdown

    texts = ["```python\nx = 1\n```\n## not a heading", "a ```` b"]
    [greedy] = cmp.build_strategies(["greedy"], [], {})
    result = cmp.StrategyResult(greedy, [cmp.Sample(text, (1,), (-1.0,), "length", 0.1)
                                         for text in texts], {})
    runs = [cmp.ModelRun("m", "none", text=text, token_ids=(1,), finish_reason="length")
            for text in texts]
    for markdown in (comparison_markdown(cmp.Comparison("m", PROMPT, 4, 1, [result])),
                     models_markdown(cmp.ModelComparison(PROMPT, greedy, runs))):
        blocks = [t.content for t in MarkdownIt().parse(markdown) if t.type == "fence"]
        assert blocks == [text + "\n" for text in texts]

# --- the command --------------------------------------------------------------------

runner = CliRunner()


def test_cli_exports_parse_back(tmp_path, stories):
    out_json, out_md = tmp_path / "c.json", tmp_path / "c.md"
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "-n", "8",
                                 "--seed", "3", "-p", "greedy", "--variant", "top_p=0.9",
                                 "--variant", "temperature=1.3", "--samples", "2",
                                 "--json", "-o", str(out_json), "--markdown", str(out_md)])
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    labels = ["greedy", "top_p=0.9", "temperature=1.3"]
    assert [s["label"] for s in data["strategies"]] == labels
    assert data["seed"] == 3 and data["prompt"] == PROMPT
    assert [len(s["outputs"]) for s in data["strategies"]] == [1, 2, 2]
    assert data["strategies"][0]["outputs"][0]["text"].startswith(", there was")
    assert data["strategies"][1]["settings"]["top_p"] == 0.9
    assert set(data["metrics"]) <= set(data["strategies"][1]["metrics"])
    markdown = out_md.read_text()
    assert all(f"## {label}" in markdown for label in labels)


def test_cli_json_to_stdout_keeps_the_view_off_stdout(stories):
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "-n", "6",
                                 "--seed", "1", "-p", "greedy", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [s["label"] for s in data["strategies"]] == ["greedy"]
    assert "tokens/s" in result.stderr  # the view (piped: panels) went to stderr


@pytest.mark.parametrize("form", ["--json", "--jsonl"])
@pytest.mark.parametrize("kind", [[], ["--quantize", "none,none"]], ids=["strategies", "models"])
def test_cli_json_to_a_file_leaves_stdout_empty(tmp_path, stories, form, kind):
    """With -o FILE the view goes to stderr, as generate's and bench's do: stdout stays
    empty (it used to get the whole view) and FILE holds the JSON."""
    out = tmp_path / "c.json"
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "-n", "6",
                                 "--seed", "1", "-p", "greedy", *kind, form, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert "tokens/s" in result.stderr  # the view (a metric row's label), on stderr
    text = out.read_text()
    docs = [json.loads(text)] if form == "--json" else [json.loads(x) for x in text.splitlines()]
    assert docs and all(d["command"] == "compare" for d in docs)
    assert ", there was" in text


def test_cli_ctrl_c_shows_what_ran_and_exits_130(stories, ctrl_c_at):
    ctrl_c_at(7 + 2)  # the 2nd step of the second strategy (8 greedy tokens: 7 steps)
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "-n", "8",
                                 "-p", "greedy", "-p", "creative", "-p", "precise",
                                 "--seed", "1", "--json"])
    assert result.exit_code == 130, result.output
    data = json.loads(result.stdout)
    assert [s["label"] for s in data["strategies"]] == ["greedy", "creative"]
    assert data["strategies"][1]["outputs"][0]["finish_reason"] == "interrupted"
    assert "creative (interrupted)" in result.stderr  # the view (on stderr) marks it
    markdown = comparison_markdown(cmp.Comparison(
        "m", PROMPT, 4, 1, [cmp.StrategyResult(cmp.build_strategies(["creative"], [], {})[0],
                                               [cmp.Sample("x", (1,), (-1.0,), "interrupted",
                                                           0.1)], {})]))
    assert "## creative (interrupted)" in markdown


def test_a_cut_column_competes_for_no_best_value(default_run):
    import dataclasses

    greedy = default_run.results[0]
    cut = dataclasses.replace(greedy, metrics={**greedy.metrics, "seconds": 1e-9},
                              samples=[dataclasses.replace(greedy.samples[0],
                                                           reason="interrupted")])
    view = View([greedy.strategy, cut.strategy], PROMPT)
    view.results = [greedy, cut]
    assert cut.interrupted and not greedy.interrupted
    assert view.best()["seconds"] == greedy.metrics["seconds"]  # not the cut one's
    markdown = comparison_markdown(cmp.Comparison("m", PROMPT, 4, 1, [greedy, cut]))
    time_row = next(line for line in markdown.splitlines() if line.startswith("| time"))
    whole, cut_cell = time_row.strip("|").split("|")[1:3]
    assert whole.strip().startswith("**") and not cut_cell.strip().startswith("**")


def test_cli_ctrl_c_in_a_model_comparison_marks_the_cut_run(ctrl_c_at, tmp_path):
    if not STORIES.is_dir():
        pytest.skip("shared models missing")
    ctrl_c_at(9 + 3)  # the 3rd step of the second model (10 greedy tokens: 9 steps)
    markdown = tmp_path / "models.md"
    result = runner.invoke(app, ["compare", PROMPT, "--models", f"{STORIES},{STORIES}",
                                 "-n", "10", "--markdown", str(markdown)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 130, result.output
    assert "(interrupted)" in result.stdout
    assert "interrupted: the table shows the runs so far" in result.stderr
    assert markdown.read_text().count("(interrupted)") == 1  # the second run only


@pytest.mark.parametrize(("args", "message"), [
    (["--variant", "temperature"], "expected KEY=VALUE"),
    (["-p", "no-such-preset"], "no-such-preset"),
    (["--json", "--markdown", "-"], "both want stdout"),
    (["--jsonl", "--markdown", "-"], "both want stdout"),
    (["-m", str(STORIES), "--models", "a,b"], "-m/--model and --models exclude each other"),
    (["--models", "a,b", "-p", "greedy", "-p", "creative"], "one strategy"),
    (["-n", "0"], "error: command line: max_new_tokens must be >= 1, got 0"),
    (["-p", "greedy", "-p", " , "], "error: --preset ' , ' names no preset"),
])
def test_cli_user_errors(args, message):
    model = [] if "--models" in args else ["-m", str(STORIES)]
    result = runner.invoke(app, ["compare", PROMPT, *model, *args])
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("form", ["--json", "--jsonl"])
def test_cli_json_and_markdown_to_one_file_are_refused(tmp_path, form):
    """The Markdown was written last over the JSON, exit 0: the JSON was lost."""
    out = tmp_path / "c.out"
    out.write_text("kept\n")
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "-n", "4",
                                 "-p", "greedy", form, "-o", str(out),
                                 "--markdown", str(tmp_path / "." / "c.out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: -o and --markdown both name ")
    assert "give them different files" in result.stderr
    assert out.read_text() == "kept\n"  # refused before anything was written


def preset_file(tmp_path: Path, name: str, model: Path) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"model: {model}\ntemperature: 0.8\n")
    return str(path)


def test_cli_presets_model_is_the_default_model(tmp_path, stories):
    """Without -m, the model the presets name runs, as `generate -p` runs a preset's
    model; -p takes a comma list, as bench's -p does."""
    story = preset_file(tmp_path, "story", STORIES)
    result = runner.invoke(app, ["compare", PROMPT, "-p", f"{story},greedy", "-n", "8",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == str(STORIES)
    assert [s["label"] for s in data["strategies"]] == ["story", "greedy"]
    assert GREEDY_START.startswith(data["strategies"][1]["outputs"][0]["text"])
    assert data["strategies"][1]["outputs"][0]["text"].startswith(", there was")


def test_cli_presets_naming_different_models_are_refused(tmp_path):
    one = preset_file(tmp_path, "one", STORIES)
    two = preset_file(tmp_path, "two", LLAMA2XS)
    result = runner.invoke(app, ["compare", PROMPT, "-p", one, "-p", two])
    assert result.exit_code == 2
    assert result.stderr == (f"error: the presets name different models ({STORIES}, "
                             f"{LLAMA2XS}); pick one with -m/--model, or compare them with "
                             f"--models\n")


def test_cli_quantize_comparison_keeps_a_failed_run_in_its_column(stories):
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "-n", "6",
                                 "--quantize", "none,4bit", "--backend", "transformers",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kind"] == "models"
    none, four = data["runs"]
    assert (none["quantize"], none["error"], none["agreement"]) == ("none", None, 1.0)
    assert none["outputs"][0]["text"].startswith(", there was")
    assert four["outputs"] == []  # a failed run has no output
    assert four["quantize"] == "4bit" and "--quantize 8bit or none" in four["error"]


# --- --logprobs ---------------------------------------------------------------------

def compare_json(*args: str) -> dict:
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def generate_output(*args: str) -> dict:
    result = runner.invoke(app, ["generate", PROMPT, "-m", str(STORIES), *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["outputs"][0]


def test_cli_logprobs_are_generates_for_the_same_settings(stories):
    """Each output's `logprobs` object is the one `generate --logprobs` writes: the
    greedy column's is greedy generate's; with --no-crn a sampled column's sample 1 is
    generate's with the seed (and its processed logprobs show the truncation)."""
    data = compare_json("-n", "8", "-p", "greedy", "--variant", "top_k=5",
                        "--variant", "strategy=beam,num_beams=2", "--samples", "2",
                        "--seed", "2", "--no-crn", "--logprobs", "3")
    greedy, top_k, beam = (s["outputs"] for s in data["strategies"])
    expected = generate_output("-n", "8", "-s", "greedy", "--logprobs", "3")["logprobs"]
    assert greedy[0]["logprobs"] == expected
    assert [e["id"] for e in expected["content"]] == greedy[0]["token_ids"]
    assert [e["logprob"] for e in expected["content"]] == greedy[0]["token_logprobs"]
    sampled = generate_output("-n", "8", "--top-k", "5", "--seed", "2", "--logprobs", "3")
    assert top_k[0]["logprobs"] == sampled["logprobs"]
    assert top_k[0]["token_ids"] == sampled["token_ids"]
    assert len(top_k) == 2 and all(len(o["logprobs"]["content"]) == 8 for o in top_k)
    assert any(e["processed_logprob"] > e["logprob"] for o in top_k
               for e in o["logprobs"]["content"])  # top-k 5 renormalised the survivors
    assert "logprobs" not in beam[0] and len(beam[0]["token_logprobs"]) == 8


def test_cli_json_says_how_the_samples_drew(stories):
    """`random_draws`: common random numbers by default, independent with --no-crn."""
    args = ("-n", "4", "-p", "greedy", "--variant", "top_k=5")
    assert compare_json(*args)["random_draws"] == "common (inverse CDF)"
    assert compare_json(*args, "--no-crn")["random_draws"] == "independent"


def test_cli_logprobs_change_no_draw(stories):
    """Recording does not move the common random numbers: the same tokens with and
    without --logprobs, and the recorded raw logprobs are the token_logprobs."""
    args = ("-n", "10", "--variant", "temperature=1.3", "--samples", "2", "--seed", "4")
    plain = compare_json(*args)["strategies"][0]["outputs"]
    recorded = compare_json(*args, "--logprobs", "2")["strategies"][0]["outputs"]
    assert [o["token_ids"] for o in recorded] == [o["token_ids"] for o in plain]
    assert all("logprobs" not in o for o in plain)
    for out in recorded:
        content = out["logprobs"]["content"]
        assert [e["logprob"] for e in content] == out["token_logprobs"]
        assert all(len(e["top_logprobs"]) == 2 for e in content)


def test_cli_logprobs_tables_under_the_view(stories):
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "-n", "4",
                                 "-p", "greedy", "--variant", "top_k=5", "--samples", "2",
                                 "--variant", "strategy=beam,num_beams=2", "--seed", "2",
                                 "--logprobs", "2"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    view_end = out.index("greedy · logprobs (raw model / processed)")
    assert "prompt: Once upon a time" in out[:view_end]  # the view first, then the tables
    assert "top_k=5 · sample 1 · logprobs" in out and "top_k=5 · sample 2 · logprobs" in out
    assert "strategy=beam,num_beams=2 · logprobs" not in out
    assert "beam search records no per-token detail" in result.stderr
    assert "' there' -3.55" in out  # greedy's first step: the runner-up, raw logprob
    quiet = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "-n", "4",
                                "-p", "greedy", "--logprobs", "2", "--json"])
    assert "logprobs (raw model" not in quiet.stdout + quiet.stderr  # the JSON has them


def test_cli_logprobs_in_a_model_comparison(stories):
    result = runner.invoke(app, ["compare", PROMPT, "--models", f"{STORIES},{STORIES}",
                                 "-n", "6", "--logprobs", "2", "--json"])
    assert result.exit_code == 0, result.output
    expected = generate_output("-n", "6", "-s", "greedy", "--logprobs", "2")["logprobs"]
    assert [r["outputs"][0]["logprobs"] for r in json.loads(result.stdout)["runs"]] == \
        [expected, expected]


def test_cli_a_variants_own_seed_is_kept(stories, tmp_path):
    """`--variant "seed=5,..."` wins over --seed (a variant's assignments win over the
    common flags): its column is generate's with seed 5; a column naming no seed takes
    --seed, as a preset does (flag > preset)."""
    data = compare_json("-n", "8", "--seed", "0", "--no-crn", "--variant",
                        "seed=5,temperature=1.0", "--variant", "seed=6,temperature=1.0",
                        "--variant", "temperature=1.0")
    five, six, common = data["strategies"]
    assert [s["settings"]["seed"] for s in data["strategies"]] == [5, 6, 0]
    for column, seed in ((five, "5"), (six, "6"), (common, "0")):
        expected = generate_output("-n", "8", "-t", "1.0", "--seed", seed)
        assert column["outputs"][0]["token_ids"] == expected["token_ids"]
    preset = tmp_path / "seeded.yaml"
    preset.write_text("name: seeded\nstrategy: sample\nseed: 7\n")
    assert compare_json("-n", "2", "-p", str(preset))["strategies"][0]["settings"]["seed"] == 7
    flagged = compare_json("-n", "2", "-p", str(preset), "--seed", "1")
    assert flagged["strategies"][0]["settings"]["seed"] == 1  # flag > preset


def test_a_grammar_compiles_before_any_column_is_timed(monkeypatch):
    """The first column to use a grammar paid for its compile (1 s of a 0.01 s greedy
    run), and lost the star for speed to the second."""
    import time

    from genlib.sampling import grammar

    if not STORIES.is_dir():
        pytest.skip("shared models missing")
    compiled = grammar._compiled

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return compiled(*args, **kwargs)

    monkeypatch.setattr(grammar, "_compiled", slow)
    monkeypatch.setattr(grammar, "_COMPILED", type(grammar._COMPILED)())
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "--regex", "[a-z ]{9}",
                                 "-p", "greedy", "-p", "beam", "-n", "5", "--json"])
    assert result.exit_code == 0, result.output
    seconds = [s["metrics"]["seconds"] for s in json.loads(result.stdout)["strategies"]]
    assert len(seconds) == 2 and max(seconds) < 0.5, seconds


def test_a_grammar_every_column_shares_that_will_not_compile_ends_it_in_one_line(
        monkeypatch):
    from genlib.errors import GrammarTimeoutError
    from genlib.sampling import grammar

    if not STORIES.is_dir():
        pytest.skip("shared models missing")
    calls = []

    def too_slow(*args, **kwargs):
        calls.append(1)
        raise GrammarTimeoutError("the regex grammar took longer than 1 s to compile")

    monkeypatch.setattr(grammar, "compile_for", too_slow)
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "--regex", "[a-z]{9}",
                                 "-p", "greedy", "-p", "beam", "-n", "5"])
    assert (result.exit_code, result.stderr.strip()) == (
        1, "error: the regex grammar took longer than 1 s to compile")
    assert len(calls) == 1  # waited once, not once a column


def test_the_markdown_export_holds_each_strategys_constraint(tmp_path):
    """It said only "Settings: greedy": the regex that shaped every sample was lost."""
    pytest.importorskip("xgrammar")
    if not STORIES.is_dir():
        pytest.skip("shared models missing")
    page = tmp_path / "c.md"
    result = runner.invoke(app, ["compare", PROMPT, "-m", str(STORIES), "--regex",
                                 "[a-z `]{9}", "-p", "greedy", "-n", "5", "--markdown",
                                 str(page)])
    assert result.exit_code == 0, result.output
    assert "Settings: `greedy`\n\nRegex:\n\n````\n[a-z `]{9}\n````\n" in page.read_text()
