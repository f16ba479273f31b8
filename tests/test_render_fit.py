"""Every Rich table at 80 and 140 columns: no line wider than the terminal, no number
cut, no row of values wrapped, every text shown in full."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

WIDTHS = (80, 140)
LONG = ("She wanted to play with the big red ball, but her mom said it was time to go home "
        "and eat dinner with the whole family. ") * 3


def render(width: int, draw) -> str:
    """What `draw(console)` prints on a terminal `width` columns wide (soft wrap on, as
    genlab's own consoles have it)."""
    console = Console(width=width, record=True, force_terminal=False, soft_wrap=True,
                      highlight=False)
    draw(console)
    text = console.export_text()
    for line in text.splitlines():
        assert len(line) <= width, f"line wider than {width}: {line!r}"
    return text


def words_in_order(text: str, rendered: str) -> bool:
    """Every word of `text`, in order, in the rendered view (however it was wrapped)."""
    flat = re.sub(r"[\s│┃|]+", " ", rendered)
    position = 0
    for word in text.split():
        position = flat.find(word, position)
        if position < 0:
            return False
        position += len(word)
    return True


# --- bench ------------------------------------------------------------------------------

def bench_record(**changes):
    record = {
        "strategy": "creative", "engine": "genlab", "backend": "compiled",
        "backend_requested": "compiled", "compile_s": 12.5, "torch_dtype": "float32",
        "quantize": "none", "prompt_tokens": 128, "new_tokens": 256, "rows": 1,
        "prefill_tps": 5321.4, "decode_tps": 642.7, "decode_tps_min": 598.1,
        "decode_tps_max": 671.9, "ttft_s": 0.0243, "itl_p50_s": 0.00152, "itl_p90_s": 0.00171,
        "itl_p99_s": 0.00298, "e2e_s": 0.4231, "peak_rss_mb": 612.0, "speedup": 4.53,
        "identical_to_baseline": True, "bound_fraction": 0.87}
    return record | changes


BENCH = [bench_record(), bench_record(engine="transformers", backend="transformers",
                                      compile_s=None, speedup=None,
                                      identical_to_baseline=None, decode_tps=141.9),
         bench_record(strategy="greedy", engine="no-cache", backend="transformers",
                      compile_s=None, speedup=0.31, prompt_tokens=1024, new_tokens=1024,
                      rows=16)]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("wide", [False, True])
def test_bench_table_keeps_every_value_whole_on_one_line(width, wide):
    from cli.bench import COLUMNS, WIDE_COLUMNS, _cells, print_table

    text = render(width, lambda c: print_table(BENCH, {"threads": 2}, c, wide)) if not wide \
        else _render_wide(width)
    lines = text.splitlines()
    for record in BENCH:
        cells = _cells(record, wide)
        row = [line for line in lines if cells["strategy"] in line and
               cells["engine"] in line and cells["prompt/new/batch"] in line]
        assert len(row) == 1, (record, text)  # one line per record: no row wraps
        hidden = [] if wide else _dropped(text)
        for name in WIDE_COLUMNS if wide else COLUMNS:
            if name not in hidden:
                assert cells[name] in row[0], (name, cells[name], row[0])  # never cut
    if not wide and width >= 100:
        assert not _dropped(text)  # the default table fits 100 columns whole


def _render_wide(width: int) -> str:
    """--wide prints at its natural width, whatever the terminal's."""
    from cli.bench import print_table

    console = Console(width=width, record=True, force_terminal=False, soft_wrap=True)
    print_table(BENCH, {"threads": 2}, console, True)
    return console.export_text()


def _dropped(text: str) -> list[str]:
    match = re.search(r"too narrow for: ([^·\n]+(?:\n[^·\n]+)?)", text)
    return [] if match is None else [n.strip() for n in match.group(1).replace("\n", " ")
                                     .split(",")]


def test_bench_default_table_fits_80_columns_with_the_usual_labels():
    from cli.bench import print_table

    usual = [bench_record(engine="genlab", backend="native", compile_s=None),
             bench_record(engine="transformers", backend="transformers", compile_s=None)]
    assert "too narrow" not in render(80, lambda c: print_table(usual, {"threads": 2}, c))


# --- compare ----------------------------------------------------------------------------

def comparison_view(n_strategies: int):
    from cli.compare import View
    from genlib.lab import compare as cmp
    from genlib.lab.metrics import METRICS

    strategies = cmp.build_strategies([], [], {"max_new_tokens": 12}, samples=2)
    strategies = (strategies * 2)[:n_strategies]
    view = View(strategies, "Once upon a time")
    for i, strategy in enumerate(strategies):
        samples = [cmp.Sample(f"{LONG}#{i}.{n}", (1,) * 12, (-1.0,) * 12, "length", 0.1)
                   for n in range(2 if strategy.stochastic else 1)]
        metrics = {m.key: 1234.5678 for m in METRICS} | {"new_tokens": 12.0}
        view.on_event(i, cmp.StrategyDone(cmp.StrategyResult(strategy, samples, metrics)))
    return view


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("n_strategies", [2, 6])
def test_compare_shows_every_text_in_full(width, n_strategies):
    from cli.compare import format_metric
    from genlib.lab.metrics import METRICS

    view = comparison_view(n_strategies)
    text = render(width, lambda c: c.print(view.render(width)))
    for index in range(n_strategies):
        for row in view.texts[index].values():
            assert words_in_order(row, text), (index, row[-20:])
    table = text[:text.index("* the best value")]  # above the legend, which names them
    for metric in METRICS:  # each metric row on one line, its values whole
        value = "12" if metric.key == "new_tokens" else format_metric(metric.key, 1234.5678)
        rows = [line for line in table.splitlines() if metric.label in line]
        assert rows and all(value in line for line in rows), (metric.label, rows)


# --- beam -------------------------------------------------------------------------------

@pytest.mark.parametrize("width", WIDTHS)
def test_beam_table_shows_texts_in_full_and_scores_whole(width, monkeypatch):
    from cli import render_beam
    from genlib.decoding.beam import Hypothesis

    hyps = [Hypothesis((1,) * 40, (-0.5,) * 40, -20.123, -0.5031 - r, f"{LONG}#{r}", "length")
            for r in range(3)]
    console = Console(width=width, record=True, force_terminal=False, soft_wrap=True)
    monkeypatch.setattr(render_beam, "out", console)
    render_beam.nbest_table("Once upon a time", hyps, None, 1.0)
    text = console.export_text()
    assert all(len(line) <= width for line in text.splitlines())
    for hyp in hyps:
        assert words_in_order(hyp.text, text)
        assert f"{hyp.score:.4f}" in text and f"{hyp.sum_logprob:.3f}" in text


# --- presets ----------------------------------------------------------------------------

@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", ["list", "keys"])
def test_presets_tables_fit(width, command, monkeypatch):
    from typer.testing import CliRunner

    from cli import render
    from cli.main import app

    console = Console(width=width, record=True, force_terminal=False, soft_wrap=True)
    monkeypatch.setattr(render, "out", console)
    result = CliRunner().invoke(app, ["presets", command])
    assert result.exit_code == 0, result.output
    text = console.export_text()
    assert all(len(line) <= width for line in text.splitlines()), text
    if command == "keys":
        from genlib.settings.config import SPECS

        for key, spec in SPECS.items():  # each key and a short default whole on one line
            default = repr(spec.default)
            if len(default) <= 14:
                assert any(key in line and default in line for line in text.splitlines()), key
            else:  # a long one (a list) folds in its column, its characters in order
                folded = "".join(re.findall(r"│ (.{14}) │", text[text.index(key):])[:3])
                assert default.replace(" ", "") in folded.replace(" ", ""), key
        meaning = max(len(line.split("│")[-1]) for line in text.splitlines() if "│" in line)
        assert meaning >= 20 if width == 80 else meaning >= 60  # the meaning has room


# --- --logprobs (generate, the REPL, compare) ---------------------------------------------

def logprobs_object(alternatives: int) -> dict:
    def entry(token: str, logprob: float | None, rank: int) -> dict:
        return {"token": token, "id": rank, "bytes": list(token.encode()), "logprob": logprob,
                "processed_logprob": None if logprob is None or rank > 3 else logprob / 2,
                "rank": rank}

    words = [" there", " extraordinarily", "\n", " a"]
    return {"content": [{**entry(word, -0.123456 * (i + 1), 0),
                         "top_logprobs": [entry(f" alt{j}word", -1.5 * j - 0.25, j)
                                          for j in range(alternatives)]}
                        for i, word in enumerate(words)]}


@pytest.mark.parametrize("width", WIDTHS)
def test_logprobs_table_keeps_every_number_whole(width):
    from cli.render_tokens import logprobs_view

    logprobs = logprobs_object(20)
    text = render(width, lambda c: c.print(logprobs_view(logprobs, "top_k=5 · sample 2")))
    flat = re.sub(r"[\s│┃|]+", " ", text)  # the wrapped alternatives, read as one line
    for i, entry in enumerate(logprobs["content"]):
        assert f"{entry['logprob']:.3f}" in text and f"{entry['processed_logprob']:.3f}" in text
        assert repr(entry["token"]) in text, i
    for alt in logprobs["content"][0]["top_logprobs"]:
        assert f"{alt['token']!r} {alt['logprob']:.2f}" in flat  # wrapped at spaces only


# --- lines of text at 80 and 60 columns: none wider, no word split ------------------------

NARROW = (80, 60)


def recording(width: int) -> Console:
    """A console like genlab's stderr one (soft wrap on, not a terminal), recording."""
    return Console(width=width, record=True, force_terminal=False, soft_wrap=True,
                   highlight=False, stderr=True)


def fits_whole(text: str, width: int, expected: str) -> None:
    """No line of `text` wider than `width`, and its words those of `expected`, in order
    and whole: lines broke at spaces only (the "·" between parts may go at a break)."""
    for line in text.splitlines():
        assert len(line) <= width, f"line wider than {width}: {line!r}"
    words = [w for w in text.split() if w != "·"]
    assert words == [w for w in expected.split() if w != "·"], text


@pytest.mark.parametrize("width", NARROW)
def test_stats_lines_fit_and_break_between_words(width, monkeypatch):
    from cli import render

    console = recording(width)
    monkeypatch.setattr(render, "err", console)
    reason = "a float32 Llama-style model on the CPU, asked for with --backend native"
    render.stats(48, 0.087, 708.93, "length", f"native ({reason})", "qwen3")
    fits_whole(console.export_text(), width,
               f"48 tokens · first token 87 ms · 708.9 tok/s · finish: length · backend "
               f"native ({reason}) · qwen3")


def tree_steps(depth: int):
    from genlib.decoding.beam import TreeCandidate, TreeStep

    return [TreeStep(step, (TreeCandidate(0, 0, 7, " extraordinarily", 0.5, -0.693 * (step + 1),
                                          "kept", 0),
                            TreeCandidate(0, 0, 8, " b", 0.25, -1.386 * (step + 1), "pruned")))
            for step in range(depth)]


@pytest.mark.parametrize("width", NARROW)
def test_beam_tree_cuts_its_lines_with_an_ellipsis(width, monkeypatch):
    from cli import render_beam
    from genlib.decoding.beam import BeamResult

    console = recording(width)
    monkeypatch.setattr(render_beam, "out", console)
    result = BeamResult(0, [], tree_steps(12))
    render_beam.search_tree(result, "Once upon a time", 12, 4)
    text = console.export_text()
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), text
    nodes = [line for line in lines if "── '" in line]
    assert len(nodes) == 24, text  # every node shown, one line each
    cut = [line for line in nodes if not line.endswith(("kept", "pruned"))]
    assert cut and all(line.endswith("…") for line in cut), cut  # cut, and says so
    note = text[text.index("(each beam"):]
    assert " ".join(note.split()) == ("(each beam shows at most 4 of the candidates "
                                      "considered from it; the rest are counted in its "
                                      "'... N more not kept' line)")


def speculation_summary():
    from genlib.decoding.speculative import Summary

    return Summary(new_tokens=48, steps=16, proposed=87, accepted=44, rejections=12,
                   draft_seconds=0.4012, target_seconds=0.8543, draft_forwards=87,
                   decode_seconds=1.3, prefill_seconds=0.05,
                   by_position=[[15, 12], [15, 9], [1, 0]], gammas=[5] * 16)


@pytest.mark.parametrize("width", NARROW)
def test_speculate_report_fits_with_every_word_whole(width, monkeypatch):
    from cli import render, speculate

    console = recording(width)
    monkeypatch.setattr(render, "err", console)
    summary = speculation_summary()
    drafter = "../shared/models/code-draft (bfloat16 weights)"
    speculate.render_report(summary, drafter, 41.37, "[green]yes[/]", False)
    rows = speculate.report_rows(summary, 41.37)
    from rich.text import Text

    expected = " ".join([f"speculation · drafter {drafter} · draft / target tokens",
                         *(f"{label} {Text.from_markup(value).plain}" for label, value in rows),
                         "greedy output identical to plain decoding: yes"])
    fits_whole(console.export_text(), width, expected)
    assert any(label == "verify cost" for label, _ in rows)  # the longest row is there


@pytest.mark.parametrize("width", NARROW)
def test_repl_help_fits_with_every_word_whole(width, monkeypatch):
    from cli import render, repl

    console = recording(width)
    monkeypatch.setattr(render, "err", console)
    repl.print_help()
    expected = " ".join([repl.HELP_INTRO, *(f"{name} {text}" for name, text in repl.HELP_KEYS),
                         "Commands:",
                         *(f"{name} {text}" for name, text in repl.HELP_COMMANDS)])
    fits_whole(console.export_text(), width, expected)


@pytest.mark.parametrize("width", [80, 140])
def test_samplers_help_shows_the_whole_default_order(width):
    from typer.testing import CliRunner

    from cli.main import app
    from genlib.settings.config import DEFAULT_SAMPLERS

    result = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": str(width)},
                                terminal_width=width)
    assert result.exit_code == 0, result.output
    block = result.output[result.output.index("--samplers"):]
    block = block[:block.index("╰")]
    words = re.sub(r"[\s│]+", " ", block).split()
    assert "…" not in block, block
    default = words[words.index("Default:") + 1:]
    assert [w.rstrip(";.") for w in default] == list(DEFAULT_SAMPLERS), block


@pytest.mark.parametrize("width", NARROW)
def test_notes_break_between_words_on_a_terminal_and_stay_one_line_in_a_file(width,
                                                                             monkeypatch):
    """compare's note on its random draws was one 165-column line on a terminal."""
    from cli import render
    from cli.compare import CRN_NOTE

    terminal = Console(width=width, record=True, force_terminal=True, soft_wrap=True,
                       highlight=False, stderr=True)
    monkeypatch.setattr(render, "err", terminal)
    render.info(CRN_NOTE)
    render.warn(CRN_NOTE)
    fits_whole(terminal.export_text(), width, f"{CRN_NOTE} warning: {CRN_NOTE}")
    piped = recording(width)
    monkeypatch.setattr(render, "err", piped)
    render.info(CRN_NOTE)
    assert piped.export_text() == f"{CRN_NOTE}\n"  # a log keeps it whole, for grep


@pytest.mark.parametrize("width", NARROW)
def test_explain_steps_fit_with_their_draw_caption(width, monkeypatch):
    from typer.testing import CliRunner

    from cli import render_explain
    from cli.main import app
    from tests.conftest import STORIES

    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    console = Console(width=width, record=True, force_terminal=False, soft_wrap=True)
    monkeypatch.setattr(render_explain, "out", console)
    result = CliRunner().invoke(app, ["explain", "Once upon", "-m", str(STORIES), "-n", "2",
                                      "-t", "0.8", "--seed", "1"])
    assert result.exit_code == 0, result.output
    text = console.export_text()
    assert all(len(line) <= width for line in text.splitlines()), text
    assert "of the cumulative distribution (vocabulary order)" in " ".join(text.split())
