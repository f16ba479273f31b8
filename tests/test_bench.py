"""genlab bench: measurement logic on a real model, and the command's JSON/CSV/plot."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
from typer.testing import CliRunner

from cli.main import app
from genlib.lab import bench
from genlib.settings.config import GenerationSettings
from tests.conftest import STORIES, torch_threads

METRICS = ("prefill_tps", "decode_tps", "ttft_s", "e2e_s", "itl_p50_s", "itl_p90_s",
           "itl_p99_s", "peak_rss_mb")


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert bench.percentile(values, 50) == 2.5
    assert bench.percentile(values, 0) == 1.0
    assert bench.percentile(values, 100) == 4.0
    assert math.isclose(bench.percentile(values, 90), 3.7)


def test_prompts_have_exactly_the_requested_length(stories):
    for length in (1, 7, 130):
        prompts = bench.exact_prompts(stories, length, 3)
        assert [len(p) for p in prompts] == [length] * 3
        assert all(p[0] == 1 for p in prompts)  # the tokenizer's BOS stays first
    assert len({tuple(p) for p in bench.exact_prompts(stories, 20, 3)}) == 3


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and the test machine is shared)."""
    with torch_threads(1):
        yield


def test_measure_forces_lengths_and_matches_transformers(stories, one_thread):
    settings = GenerationSettings()
    cases = [bench.Case("greedy", settings, 9, 17, 1),
             bench.Case("greedy", settings, 9, 17, 1, cache=False)]
    group = bench.measure(stories, cases, runs=2, warmup=0, baseline=True)
    assert group.baseline is not None
    for result in [*group.results, group.baseline]:
        assert len(result.runs) == 2
        for run in result.runs:
            assert run.steps == 17 and run.prompt_tokens == 9
            assert [len(ids) for ids in run.token_ids] == [17]
            assert len(run.inter_token_s) == 16
            assert 0 < run.ttft_s <= run.e2e_s
        assert result.peak_rss_mb and result.peak_rss_mb > 0
    assert group.identical(group.results[0]) is True  # KV-cache loop == generate()
    assert group.identical(group.results[1]) is True  # naive loop == generate()
    assert group.speedup(group.results[0]) > 0


class FixedProbe(bench.BandwidthProbe):
    """Returns preset bandwidths instead of measuring."""

    def __init__(self, values):
        super().__init__()
        self.values = iter(values)

    def sample(self):
        self.samples.append(next(self.values))
        return self.samples[-1]


def test_bandwidth_is_sampled_once_a_round_and_the_bound_uses_the_median(
        stories, one_thread):
    probe = FixedProbe([30e9, 90e9, 40e9, 50e9, 60e9])
    cases = [bench.Case("greedy", GenerationSettings(), 4, 3, 1)]
    first = bench.measure(stories, cases, runs=3, warmup=0, baseline=False, probe=probe)
    second = bench.measure(stories, cases, runs=2, warmup=0, baseline=False, probe=probe)
    assert first.bandwidth == [30e9, 90e9, 40e9]  # one sample per round, in order
    assert second.bandwidth == [50e9, 60e9]
    assert first.bound_tps(10**6) == 40e9 / 10**6  # the median: not the quiet spell's 90
    assert second.bound_tps(10**6) == 55e9 / 10**6
    assert bench.measure(stories, cases, runs=1, warmup=0, baseline=False).bound_tps(1) is None


@pytest.mark.slow
def test_a_compiled_step_is_warmed_up_even_with_warmup_0(one_thread):
    """A float16 model on the compiled backend: its compilation goes into an uncounted
    warm-up run (reported as compile_s), never into the counted runs."""
    from genlib.models.loading import ModelSpec, load_model

    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    lm = load_model(ModelSpec(str(STORIES), dtype="float16"))
    case = bench.Case("greedy", GenerationSettings(), 4, 4, 1, backend="compiled")
    [result] = bench.measure(lm, [case], runs=1, warmup=0, baseline=False).results
    assert result.backend == "compiled"
    assert result.first_run_s is not None  # the compiling run, uncounted
    assert result.metrics()["compile_s"] is not None


def run_cli(*args: str):
    return CliRunner().invoke(app, ["bench", "-m", str(STORIES), *args])


@pytest.fixture(scope="module")
def sweep_json():
    import torch

    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    before = torch.get_num_threads()
    result = run_cli("--json", "--threads", "1", "--runs", "2", "--warmup", "0",
                     "--prompt-len", "8", "--new-tokens", "5,12", "--batch-size", "1,2",
                     "--strategy", "greedy", "-p", "creative", "--no-cache", "--baseline",
                     "transformers", "--no-bandwidth")
    torch.set_num_threads(before)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_has_every_metric_for_every_configuration(sweep_json):
    results = sweep_json["results"]
    # 2 strategies (a preset among them) x 2 lengths x 2 batch sizes, each: genlab,
    # no-cache, transformers
    assert len(results) == 2 * 2 * 2 * 3
    for r in results:
        for key in METRICS:
            for suffix in ("", "_min", "_max") if not key.startswith(("itl", "peak")) else ("",):
                assert isinstance(r[key + suffix], float) and r[key + suffix] >= 0, (key, r)
        assert r["new_tokens"] == r["new_tokens_requested"]
        assert r["prompt_tokens"] == r["prompt_len"] == 8
        assert r["rows"] == r["batch_size"]
    seen = {(r["strategy"], r["engine"], r["new_tokens"], r["batch_size"]) for r in results}
    assert len(seen) == len(results)
    assert sweep_json["machine"]["threads"] == 1


def test_json_reports_speedup_and_greedy_identity(sweep_json):
    for r in sweep_json["results"]:
        if r["engine"] == "transformers":
            assert r["speedup"] is None
        else:
            assert r["speedup"] > 0
        if r["strategy"] == "greedy" and r["engine"] != "transformers":
            assert r["identical_to_baseline"] is True, r
        if r["strategy"] == "creative":  # a sampling preset: no identity to check
            assert r["identical_to_baseline"] is None


def test_csv_plot_and_table(tmp_path, one_thread):
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    pytest.importorskip("matplotlib")
    csv_file, png = tmp_path / "b.csv", tmp_path / "b.png"
    result = run_cli("--runs", "1", "--prompt-len", "4", "--new-tokens", "3,6",
                     "--csv", str(csv_file), "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert re.search(r"decode\s.*\n.*tok/s", result.stdout) and "genlab" in result.stdout
    assert "bound" in result.stdout  # the memory-bandwidth bound is measured and printed
    rows = list(csv.DictReader(csv_file.open()))
    assert [int(r["new_tokens"]) for r in rows] == [3, 6]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_bound_comes_from_the_bandwidth_sampled_between_rounds(one_thread, monkeypatch):
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    samples = iter([10e9, 20e9, 70e9, 80e9])  # the probe's reads, in order
    monkeypatch.setattr(bench, "read_bandwidth", lambda **kwargs: next(samples))
    result = run_cli("--json", "--runs", "2", "--warmup", "0", "--prompt-len", "4",
                     "--new-tokens", "3,5")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    machine, results = doc["machine"], doc["results"]
    assert (machine["read_bandwidth_gbs"], machine["read_bandwidth_gbs_min"],
            machine["read_bandwidth_gbs_max"], machine["bandwidth_samples"]) == (45, 10, 80, 4)
    (weights,) = machine["weight_bytes"].values()
    for r in results:  # each configuration: the median of its own two rounds' samples
        assert r["read_bandwidth_gbs"] == {3: 15, 5: 75}[r["new_tokens"]]
        assert math.isclose(r["bandwidth_bound_tps"], r["read_bandwidth_gbs"] * 1e9 / weights)
        assert math.isclose(r["bound_fraction"], r["decode_tps"] / r["bandwidth_bound_tps"])


@pytest.mark.parametrize("args, message", [
    (("--prompt-len", "12,x"), "--prompt-len: 'x' is not a positive integer"),
    (("--new-tokens", "0"), "--new-tokens: '0' is not a positive integer"),
    (("--new-tokens", "4,1"), "--new-tokens: 1 token has no decode step to time"),
    (("--baseline", "vllm"), "--baseline must be one of none, transformers, got 'vllm'"),
    (("--quantize", "3bit"),
     "--quantize must be one of none, 8bit, 4bit, q8_0, nf4, q4_0, got '3bit'"),
    (("--strategy", "beam"), "beam search is not supported"),
    (("--strategy", "creative"), "'creative' is not a strategy; use greedy, sample, or give "
                                 "a preset with -p creative"),
    (("--prompt-len", "500", "--new-tokens", "100"), "exceeds the model's 512 positions"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    result = run_cli("--no-bandwidth", *args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_presets_model_is_the_default_model(tmp_path):
    """Without -m, bench measures the model its presets name (as `generate -p` runs a
    preset's model), and refuses presets that name different ones."""
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    story, other = tmp_path / "story.yaml", tmp_path / "other.yaml"
    story.write_text(f"model: {STORIES}\n")
    other.write_text(f"model: {STORIES.parent / 'llama2xs'}\n")
    result = CliRunner().invoke(app, ["bench", "-p", f"{story},greedy", "--json",
                                      "--runs", "1", "--warmup", "0", "--prompt-len", "4",
                                      "--new-tokens", "3", "--no-bandwidth"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["model"] == str(STORIES)
    assert [r["strategy"] for r in doc["results"]] == [str(story), "greedy"]
    result = CliRunner().invoke(app, ["bench", "-p", str(story), "-p", str(other)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: the presets name different models")


@pytest.mark.parametrize("preset, message", [
    ("name: penalised\nstrategy: greedy\npresence_penalty: 1.5\n",
     "uses presence_penalty, which model.generate() does not have"),
    ("name: dry\nstrategy: sample\ndry_multiplier: 0.8\n",
     "uses dry, which model.generate() does not have"),
    ("name: ordered\nstrategy: sample\ntemperature: 0.7\ntop_p: 0.9\n"
     "samplers: [top_p, temperature]\n",
     "uses the samplers order top_p, temperature, where model.generate() runs "
     "temperature, top_p"),
])
def test_a_baseline_that_cannot_run_the_settings_is_refused(tmp_path, preset, message):
    """The baseline never silently runs other settings (a greedy run would read 'same
    tokens: NO', a sampled one be timed on other work): refused before any run."""
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    path = tmp_path / "preset.yaml"
    path.write_text(preset)
    result = run_cli("-p", str(path), "--baseline", "transformers", "--runs", "1",
                     "--prompt-len", "4", "--new-tokens", "4", "--no-bandwidth")
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output and "decode" not in result.stdout


def test_baseline_runs_what_generate_has_with_every_value_passed():
    from genlib.settings.config import resolve_settings
    from genlib.settings.presets import load_preset

    sample = resolve_settings({"strategy": "sample", "temperature": 0.7, "top_p": 0.9})
    assert sample.do_sample and bench.baseline_gap(sample) is None
    assert bench.baseline_gap(resolve_settings({"repetition_penalty": 1.3})) is None
    for name in ("creative", "precise", "topk"):
        assert bench.baseline_gap(resolve_settings({}, load_preset(name).settings)) is None
    # top_k off is passed as 0: None would let a model's generation_config top_k in
    assert bench.baseline_kwargs(sample)["top_k"] == 0
    cut = resolve_settings({"strategy": "sample", "epsilon_cutoff": 3e-4, "eta_cutoff": 2e-3})
    assert bench.baseline_gap(cut) is None
    assert (bench.baseline_kwargs(cut)["epsilon_cutoff"],
            bench.baseline_kwargs(cut)["eta_cutoff"]) == (3e-4, 2e-3)


def test_one_case_per_backend_asked_for_and_the_no_cache_loop():
    from cli.bench import build_cases

    groups = build_cases([("greedy", GenerationSettings())], [8], [4], [1, 2],
                         ["auto", "lean"], no_cache=True)
    assert [[(bench.engine_name(c), c.backend) for c in g] for g in groups] == \
        [[("genlab", "auto"), ("genlab", "lean"), ("no-cache", "auto")]] * 2


def test_csv_on_stdout_is_clean_csv(one_thread):
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    result = run_cli("--runs", "1", "--warmup", "0", "--prompt-len", "4", "--new-tokens", "3",
                     "--no-bandwidth", "--csv", "-")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(result.stdout.splitlines()))
    assert len(rows) == 1 and rows[0]["engine"] == "genlab" and rows[0]["new_tokens"] == "3"
    assert re.search(r"decode\s.*\n.*tok/s", result.stderr)  # the table went to stderr
    both = run_cli("--runs", "1", "--json", "--csv", "-")
    assert both.exit_code == 2 and "both write to stdout" in both.stderr


def test_a_csv_folder_gone_during_the_sweep_is_one_line_after_the_table(
        tmp_path, monkeypatch, one_thread):
    import shutil

    from cli import bench as cli_bench

    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    folder = tmp_path / "out"
    folder.mkdir()
    sweep = cli_bench.run_sweep

    def sweep_then_remove(*args, **kwargs):
        done = sweep(*args, **kwargs)
        shutil.rmtree(folder)  # removed while the bench ran
        return done

    monkeypatch.setattr(cli_bench, "run_sweep", sweep_then_remove)
    result = run_cli("--runs", "1", "--warmup", "0", "--prompt-len", "4", "--new-tokens", "3",
                     "--no-bandwidth", "--csv", str(folder / "b.csv"))
    assert result.exit_code == 2
    assert re.search(r"decode\s.*\n.*tok/s", result.stdout)  # the results are shown
    assert f"--csv: cannot write {folder / 'b.csv'}" in " ".join(result.stderr.split())
    assert "unexpected" not in result.stderr


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_every_record_names_the_backend_that_ran(one_thread, monkeypatch, native_on):
    """auto runs the native kernel where it builds, the lean forward with
    GENLAB_NATIVE=0; an explicit backend runs as asked; the baseline is transformers'.
    The records take the name from the backend object that ran (its Prefill event)."""
    from genlib.backends import kernel

    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    monkeypatch.setenv("GENLAB_NATIVE", native_on)
    expected = "native" if native_on == "1" and kernel.build().library else "lean"
    result = run_cli("--backend", "auto,transformers", "--baseline", "transformers",
                     "--runs", "1", "--prompt-len", "4", "--new-tokens", "3",
                     "--no-bandwidth", "--csv", "-")
    assert result.exit_code == 0, result.output
    records = [(r["engine"], r["backend_requested"], r["backend"])
               for r in csv.DictReader(result.stdout.splitlines())]
    assert records == [("genlab", "auto", expected), ("genlab", "transformers", "transformers"),
                       ("transformers", "", "transformers")]


def test_a_backend_that_cannot_serve_is_refused_before_any_run():
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    result = run_cli("--backend", "warp", "--runs", "1", "--no-bandwidth")
    assert result.exit_code == 2 and "--backend must be one of auto," in result.output
    assert "got 'warp'" in result.output
    result = run_cli("--compile", "--runs", "1", "--no-bandwidth")
    assert result.exit_code == 2 and "--compile was replaced by --backend" in result.output


def test_a_backend_one_configuration_cannot_use_is_refused_before_any_run(monkeypatch):
    """--backend lean over --batch-size 1,2: refused before batch size 1 is measured
    (and its records thrown away), with the line that names what would work."""
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    runs = []
    monkeypatch.setattr(bench, "genlab_run", lambda *args: runs.append(args))
    result = run_cli("--backend", "auto,lean", "--batch-size", "1,2", "--runs", "1",
                     "--prompt-len", "4", "--new-tokens", "3", "--no-bandwidth")
    assert result.exit_code == 2 and runs == []
    assert "the lean backend runs one row, and this generation needs 2 rows at once; use " \
           "--backend" in result.output


def test_the_table_names_the_backend_and_its_compile_time():
    from cli.bench import engine_label

    plain = {"engine": "genlab", "backend": "native", "compile_s": None}
    assert engine_label(plain) == "genlab/native"
    compiled = {"engine": "genlab", "backend": "compiled", "compile_s": 0.25}
    assert engine_label(compiled) == "genlab/compiled (compile 0.2s)"


# --- --fidelity ------------------------------------------------------------------------

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play in the "
         "park with her friends. One day, she found a big red ball under a tree. She was "
         "very happy and ran to show her mom. \"That is a nice ball,\" her mom said. ") * 6


def fidelity_run(tmp_path, *args: str):
    text = tmp_path / "held_out.txt"
    text.write_text(STORY, encoding="utf-8")
    return CliRunner().invoke(app, ["bench", "-m", str(STORIES), "--fidelity", str(text),
                                    *args])


def test_fidelity_compares_each_format_with_float32(tmp_path):
    """float32 against itself agrees everywhere at no divergence; q8_0 stays within a
    percent of its perplexity and agrees on nearly every argmax; the 4-bit formats move
    the distributions more than q8_0 does. The document validates against the schema."""
    from jsonschema import Draft202012Validator

    from tests.test_output import SCHEMA

    result = fidelity_run(tmp_path, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert list(Draft202012Validator(SCHEMA).iter_errors(doc)) == []
    rows = {r["weights"]: r for r in doc["results"]}
    assert list(rows) == ["float32", "q8_0", "nf4", "q4_0"] and doc["kind"] == "fidelity"
    windows = math.ceil(doc["tokens"] / 256)  # each predicts all but its last token
    assert {r["positions"] for r in rows.values()} == {doc["tokens"] - windows}
    base = rows["float32"]
    assert base["top1_agreement"] == 1.0 and base["mean_kl"] == 0.0
    assert windows >= 2 and base["perplexity_error"] == 0.0
    assert all(0 < rows[f]["perplexity_error"] < 0.1 for f in ("q8_0", "nf4", "q4_0"))
    assert abs(rows["q8_0"]["perplexity"] / base["perplexity"] - 1) < 0.01
    assert rows["q8_0"]["top1_agreement"] > 0.95
    for four_bit in ("nf4", "q4_0"):
        assert rows[four_bit]["mean_kl"] > rows["q8_0"]["mean_kl"] > 0


def test_fidelity_table_gives_each_change_its_error_within_80_columns(tmp_path):
    result = fidelity_run(tmp_path, "--quantize", "q8_0")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    base, row = (next(line for line in lines if line.lstrip().startswith(name))
                 for name in ("float32", "q8_0"))
    assert re.search(r"[+-]\d+\.\d\d% ± \d+\.\d\d%", row) and "±" not in base
    assert "± one standard error over the windows" in result.stdout
    assert max(len(line) for line in lines) <= 80


def test_fidelity_takes_the_formats_quantize_names(tmp_path):
    result = fidelity_run(tmp_path, "--quantize", "8bit,q4_0", "--json")
    assert result.exit_code == 0, result.output
    assert [r["weights"] for r in json.loads(result.stdout)["results"]] == \
        ["float32", "q8_0", "q4_0"]


@pytest.mark.parametrize("args, said", [
    (["--baseline", "transformers", "--batch-size", "2"],
     "error: --fidelity measures what quantization keeps, not speed: drop --batch-size, "
     "--baseline"),
    (["--jsonl"], "error: --fidelity writes one document, a row per format: give --json, "
     "not --jsonl"),
])
def test_fidelity_refuses_the_speed_flags(tmp_path, args, said):
    result = fidelity_run(tmp_path, *args)
    assert result.exit_code == 2 and result.stderr.strip() == said


def test_fidelity_names_a_text_it_cannot_read(tmp_path):
    missing = tmp_path / "nowhere.txt"
    result = CliRunner().invoke(app, ["bench", "-m", str(STORIES), "--fidelity",
                                      str(missing)])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: --fidelity: cannot read {missing}: No such "
                                     f"file or directory")


def test_fidelity_of_a_quantized_checkpoint_says_what_float32_means(tmp_path):
    """The built-in model is stored in nf4: its float32 row is the dequantized weights,
    so nf4 agrees with it everywhere (to float32 rounding), and the run says so."""
    text = tmp_path / "held_out.py"
    text.write_text("def add(a, b):\n    return a + b\n" * 20, encoding="utf-8")
    result = CliRunner().invoke(app, ["bench", "--fidelity", str(text), "--quantize",
                                      "4bit", "--json"])
    assert result.exit_code == 0, result.output
    assert "builtin:code-small is stored in nf4: float32 here is its dequantized weights" \
        in result.stderr
    nf4 = json.loads(result.stdout)["results"][1]  # the same products, summed in another order
    assert (nf4["weights"], nf4["top1_agreement"]) == ("nf4", 1.0) and nf4["mean_kl"] < 1e-9


def test_an_interrupted_sweep_reports_and_exports_what_it_measured(tmp_path, one_thread,
                                                                    monkeypatch):
    """Ctrl-C lost every row measured before it ("error: interrupted", no CSV)."""
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    measured = bench.measure

    def measure(lm, cases, *args, **kwargs):
        if cases[0].prompt_len == 8:
            raise KeyboardInterrupt
        return measured(lm, cases, *args, **kwargs)

    monkeypatch.setattr(bench, "measure", measure)
    table = tmp_path / "rows.csv"
    result = run_cli("--json", "--runs", "1", "--warmup", "0", "--prompt-len", "4,8",
                     "--new-tokens", "3", "--no-bandwidth", "--csv", str(table))
    assert result.exit_code == 130, result.output
    doc = json.loads(result.stdout)
    assert [r["prompt_len"] for r in doc["results"]] == [4]
    assert doc["machine"]["interrupted"] is True
    assert [row["prompt_len"] for row in csv.DictReader(table.open())] == ["4"]
    assert "warning: interrupted: the 1 row measured before it are reported" in result.stderr


def test_a_run_the_loop_cut_short_is_an_interruption_not_a_measurement():
    """The decode loop ends rows "interrupted" on Ctrl-C; bench timed them as done runs
    (34 of 64 tokens) and went on."""
    from genlib.events import Finish, Prefill, Token

    events = [Prefill((2,), 0.1, 1.0),
              Token(row=0, token_id=5, text="a", logprob=-1.0, index=0, time=1.1),
              Token(row=0, token_id=6, text="b", logprob=-1.0, index=1, time=1.2),
              Finish(0, 0, "interrupted", (5, 6), "ab", 2, 1.0, 1.1, 1.2)]
    with pytest.raises(KeyboardInterrupt):
        bench.run_from_events(events, 1.0)


def test_a_format_sweep_names_each_rows_format_in_the_table(one_thread, monkeypatch):
    """The rows of --quantize none,8bit were identical but for their figures."""
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    monkeypatch.setenv("COLUMNS", "100")
    result = run_cli("--runs", "1", "--warmup", "0", "--prompt-len", "4", "--new-tokens",
                     "3", "--no-bandwidth", "--quantize", "none,8bit")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines() if "genlab/" in line]
    assert [row[2] for row in rows] == ["float32/none", "float32/8bit"]
    single = run_cli("--runs", "1", "--warmup", "0", "--prompt-len", "4", "--new-tokens", "3",
                     "--no-bandwidth")
    assert "dtype/quant" not in single.stdout  # nothing swept: no column for it
