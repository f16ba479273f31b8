"""`genlab bench`: measure generation speed (prefill and decode tokens/s, time to first
token, inter-token latency, end-to-end time, peak memory) over a sweep of settings,
optionally against transformers' `model.generate()` measured in the same run."""

from __future__ import annotations

import csv
import os
import sys
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import options as opt
from cli.context import ModelFlags, load, presets_model, settings_for
from cli.errors import INTERRUPTED, fail, user_errors
from cli.output import Sink, opened, sink
from cli.paths import check_output_path
from genlib.backends.choose import BACKENDS
from genlib.errors import not_one_of
from genlib.models.loading import QUANTIZATIONS

if TYPE_CHECKING:
    from genlib.lab.bench import Case, Group, Result
    from genlib.models.loading import LoadedModel
    from genlib.settings.config import GenerationSettings

BASELINES = ("none", "transformers")
STRATEGIES = ("greedy", "sample")
SWEPT = ("prompt_len", "new_tokens", "batch_size", "dtype", "quantize")


def int_list(flag: str, text: str) -> list[int]:
    """'128,256' -> [128, 256]; every value a positive integer."""
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise fail(f"{flag}: {item!r} is not a positive integer (give a comma list like "
                       f"64,128)")
        values.append(int(item))
    return values


def check_decode_steps(counts: list[int]) -> None:
    """Decode tokens/s is timed from the first token to the last: one token has no
    decode step to time (its tokens/s would read 0)."""
    if min(counts) < 2:
        raise fail("--new-tokens: 1 token has no decode step to time (decode tokens/s runs "
                   "from the first token to the last); give 2 or more")


def str_list(flag: str, text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    values = opt.comma_list(text)
    if not values:
        raise fail(f"{flag}: give at least one value")
    for value in values:
        if allowed is not None and value not in allowed:
            raise fail(not_one_of(flag, value, allowed))
    return values


def measured(strategies: list[str], presets: list[str]) -> list[tuple[str, bool]]:
    """What to measure, in order: (name, whether it is a preset). -s takes strategies
    only and -p presets only, as in every other command."""
    for name in strategies:
        if name == "beam":
            raise fail("beam: bench measures the greedy/sampling decode loop; beam search "
                       "is not supported here yet")
        if name not in STRATEGIES:
            raise fail(f"--strategy: {name!r} is not a strategy; use {', '.join(STRATEGIES)}, "
                       f"or give a preset with -p {name}")
    return [(name, False) for name in strategies] + [(name, True) for name in presets]


def strategy_settings(names: list[tuple[str, bool]], seed: int, baseline: bool = False
                      ) -> list[tuple[str, GenerationSettings]]:
    """Each name is a strategy (greedy, sample) or a preset; sampling runs get `seed`.
    With the `baseline`, settings that model.generate() cannot run are refused here,
    before any run, rather than dropped from the baseline's."""
    from genlib.lab.bench import baseline_gap

    out = []
    for name, is_preset in names:
        flags: dict[str, Any] = {} if is_preset else {"strategy": name}
        settings, _ = settings_for(name if is_preset else None, flags, seed=seed)
        if settings.strategy == "beam":
            raise fail(f"{name}: bench measures the greedy/sampling decode loop; beam search "
                       f"is not supported here yet")
        gap = baseline_gap(settings) if baseline else None
        if gap is not None:
            raise fail(f"--baseline transformers: {name} uses {gap}, so the baseline would "
                       f"run other settings; measure {name} without --baseline")
        out.append((name, settings))
    return out


def build_cases(strategies: list[tuple[str, GenerationSettings]], prompt_lens: list[int],
                new_tokens: list[int], batch_sizes: list[int], backends: list[str],
                no_cache: bool) -> list[list[Case]]:
    """One group per configuration: genlab on each backend asked for, plus the no-cache
    loop when asked for (they share prompts and the baseline, and run interleaved);
    `strategy_settings` has refused beam search already."""
    from genlib.lab.bench import Case

    groups = []
    for (label, settings), p, n, b in product(strategies, prompt_lens, new_tokens, batch_sizes):
        group = [Case(label, settings, p, n, b, backend=name) for name in backends]
        if no_cache:
            group.append(Case(label, settings, p, n, b, cache=False))
        groups.append(group)
    return groups


def record(lm: LoadedModel, dtype: str, quantize: str, engine_result: Result, group: Group,
           runs: int, warmup: int) -> dict[str, Any]:
    """One JSON/CSV record: what was run, every metric, and how it compares (the bound
    from the bandwidth sampled between this configuration's rounds and the bytes of
    weights the backend that ran holds)."""
    from genlib.backends.choose import architecture, stored_format

    case = engine_result.case
    metrics = engine_result.metrics()
    bound_tps = group.bound_tps(engine_result.weight_bytes or 0)
    bandwidth = group.median_bandwidth()
    row: dict[str, Any] = {
        "model": lm.ref, "strategy": case.label, "engine": engine_result.engine,
        "dtype": dtype, "torch_dtype": lm.dtype_name,
        "quantize": quantize, "prompt_len": case.prompt_len, "new_tokens_requested":
        case.new_tokens, "batch_size": case.batch_size,
        "architecture": architecture(lm),
        "backend": engine_result.backend,
        "weights": lm.weights or stored_format(lm) or lm.dtype_name
        if engine_result.backend == "native" else None,
        "backend_requested":
        case.backend if engine_result.engine == "genlab" else None,
        "runs": runs, "warmup": warmup, "settings": case.settings.to_dict(), **metrics,
        "speedup": group.speedup(engine_result),
        "identical_to_baseline": group.identical(engine_result),
        "weight_bytes": engine_result.weight_bytes,
        "read_bandwidth_gbs": bandwidth / 1e9 if bandwidth else None,
        "bandwidth_bound_tps": bound_tps * case.batch_size if bound_tps else None,
    }
    bound = row["bandwidth_bound_tps"]
    row["bound_fraction"] = metrics["decode_tps"] / bound if bound else None
    return row


def weights_key(r: dict[str, Any]) -> str:
    """What `machine.weight_bytes` files a record's weights under: the dtype and
    quantization asked for, and the engine and backend that read them."""
    return f"{r['dtype']}/{r['quantize']} {engine_label(r, compile_time=False)}"


def engine_label(r: dict[str, Any], compile_time: bool = True) -> str:
    """The engine, the backend it ran on (where they differ), and what compiling took
    where it compiled."""
    took = "" if r["compile_s"] is None or not compile_time else \
        f", compile {r['compile_s']:.1f}s"
    if r.get("backend") in (None, "", r["engine"]) and not took:
        return r["engine"]
    if not took:
        return f"{r['engine']}/{r['backend']}"
    return f"{r['engine']}/{r.get('backend') or '-'} ({took.removeprefix(', ')})"


def check_plot_available(plot: str | None) -> None:
    if plot is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise fail("--plot needs matplotlib: pip install 'genlab[plot]'") from None


@user_errors
def bench(
    model: opt.Model = None,
    strategy: Annotated[str | None, typer.Option(
        "--strategy", "-s", help="Comma list of strategies to measure: greedy, sample "
        "(default greedy, unless -p is given).")] = None,
    preset: opt.Presets = None,
    prompt_len: Annotated[str, typer.Option(
        "--prompt-len", help="Comma list of prompt lengths in tokens (exact).")] = "128",
    new_tokens: Annotated[str, typer.Option(
        "--new-tokens", help="Comma list of new-token counts, each at least 2 (generation "
        "is forced to this length; end tokens are ignored).")] = "256",
    batch_size: Annotated[str, typer.Option(
        "--batch-size", help="Comma list of batch sizes (a size whose KV cache cannot fit "
        "in the memory available is refused before any run).")] = "1",
    dtype: Annotated[str, typer.Option(
        "--dtype", help="Comma list of dtypes: auto, float32, bfloat16, float16.")] = "auto",
    quantize: Annotated[str, typer.Option(
        "--quantize", help="Comma list: none, 8bit, 4bit, q8_0, nf4, q4_0 (see generate's "
        "--quantize).")] = "none",
    runs: Annotated[int, typer.Option("--runs", min=1, help="Counted runs per "
                                      "configuration (medians reported).")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Uncounted warm-up runs "
                                        "(at least one for the compiled backend).")] = 1,
    baseline: Annotated[str, typer.Option(
        "--baseline", help="none, or transformers: model.generate() on the same inputs, "
        "interleaved with genlab's runs.")] = "none",
    backend: Annotated[str, typer.Option(
        "--backend", help="Comma list of backends to measure genlab on, interleaved: auto, "
        "transformers, lean, compiled, native (compile time reported apart, never in "
        "tokens/s).")] = "auto",
    compile: opt.RetiredCompile = False,
    no_cache: Annotated[bool, typer.Option(
        "--no-cache", help="Also measure the naive loop that re-runs the whole sequence "
        "every step (quadratic) against the KV-cache loop (linear).")] = False,
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, help="torch CPU threads for every engine (default: torch's).")]
        = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed for sampling strategies.")] = 0,
    as_json: opt.Json = False,
    as_jsonl: opt.Jsonl = False,
    output: opt.OutputFile = None,
    wide: Annotated[bool, typer.Option(
        "--wide", rich_help_panel=opt.OUTPUT_PANEL, help="Show every column of the table "
        "(spreads, latency percentiles, memory, token identity), however wide.")] = False,
    csv_path: Annotated[str | None, typer.Option(
        "--csv", help="Also write the results as CSV to this file (`-` for stdout).")] = None,
    plot: Annotated[str | None, typer.Option(
        "--plot", help="Draw decode tokens/s against the swept variable into this PNG "
        "(needs matplotlib).")] = None,
    bandwidth: Annotated[bool, typer.Option(
        "--bandwidth/--no-bandwidth", help="Measure memory read bandwidth and report the "
        "bound it puts on decode tokens/s.")] = True,
    device: opt.Device = "auto",
    trust_remote_code: opt.TrustRemoteCode = False,
    fidelity_file: Annotated[Path | None, typer.Option(
        "--fidelity", metavar="FILE", help="Measure what each quantized format keeps, not "
        "speed: FILE's text (held out: not trained on) through the float32 model and "
        "each --quantize format (default q8_0, nf4 and q4_0) on the native kernel, in "
        "windows of 256 tokens; perplexity, top-1 agreement with float32, and the mean "
        "KL divergence from float32's next-token distributions.")] = None,
) -> None:
    """Measure generation speed honestly: warm-up, counted runs, medians and spread.

    Examples:\n
      genlab bench -m ../shared/models/stories260K --baseline transformers --backend auto,lean\n
      genlab bench -m ../shared/models/stories260K --no-cache --new-tokens 64,128,256,384\n
      genlab bench -m ../shared/models/code-target --batch-size 1,4 --json\n
      genlab bench -m ../shared/models/code-target --fidelity held_out.py
    """
    opt.refuse_compile(compile)
    target = sink(as_json, as_jsonl, output)
    if fidelity_file is not None:
        speed_only = {"--strategy": strategy is not None, "-p/--preset": bool(preset),
                      "--prompt-len": prompt_len != "128", "--new-tokens": new_tokens != "256",
                      "--batch-size": batch_size != "1", "--dtype": dtype != "auto",
                      "--baseline": baseline != "none", "--backend": backend != "auto",
                      "--no-cache": no_cache, "--csv": csv_path is not None,
                      "--plot": plot is not None, "--wide": wide}
        refuse_with_fidelity([flag for flag, given in speed_only.items() if given])
        if as_jsonl:
            raise fail("--fidelity writes one document, a row per format: give --json, "
                       "not --jsonl")
        check_threads(threads)
        with opened(target):
            return run_fidelity(model, device, trust_remote_code, fidelity_file,
                                str_list("--quantize", quantize, QUANTIZATIONS), threads,
                                target)
    presets = opt.preset_refs(preset)
    names = measured(str_list("--strategy", strategy) if strategy is not None
                     else [] if presets else ["greedy"], presets)
    lengths = int_list("--prompt-len", prompt_len)
    counts = int_list("--new-tokens", new_tokens)
    check_decode_steps(counts)
    batches = int_list("--batch-size", batch_size)
    dtypes = str_list("--dtype", dtype, ("auto", "float32", "bfloat16", "float16"))
    quants = str_list("--quantize", quantize, QUANTIZATIONS)
    backends = str_list("--backend", backend, BACKENDS)
    if baseline not in BASELINES:
        raise fail(not_one_of("--baseline", baseline, BASELINES))
    check_plot_available(plot)
    if plot is not None:
        check_output_path(Path(plot), "--plot")
    if target.machine and target.to_stdout and csv_path == "-":
        raise fail(f"--{target.mode} and --csv - both write to stdout; send the CSV to a file")
    if csv_path is not None and csv_path != "-":
        check_output_path(Path(csv_path), "--csv")
    check_threads(threads)
    groups = build_cases(strategy_settings(names, seed, baseline == "transformers"), lengths,
                         counts, batches, backends, no_cache)
    if model is None:
        model = presets_model(presets)
    records, machine = run_sweep(model, device, trust_remote_code, dtypes, quants, groups,
                                 runs, warmup, baseline == "transformers", threads, bandwidth)
    with opened(target):
        emit(records, machine, target, csv_path, plot, wide)
    if machine.get("interrupted"):
        from cli import render

        render.warn(f"interrupted: the {render.counted(len(records), 'row')} measured "
                    f"before it are reported; the rest did not run")
        raise typer.Exit(INTERRUPTED)


# --- --fidelity: what each quantized format keeps ------------------------------------

FIDELITY_WINDOW = 256


def refuse_with_fidelity(flags: list[str]) -> None:
    """A usage error for the speed flags given with --fidelity, which measures quality."""
    if flags:
        raise fail(f"--fidelity measures what quantization keeps, not speed: drop "
                   f"{', '.join(flags)}")


def fidelity_formats(quants: list[str]) -> list[str]:
    """The kernel formats --quantize names (`choose.NATIVE_FORMATS`: 8bit is q8_0, 4bit
    nf4), float32 first; every format where it names none."""
    from genlib.backends.choose import NATIVE_FORMATS

    named = [NATIVE_FORMATS[q] for q in quants if q != "none"]
    return ["float32", *dict.fromkeys(named or NATIVE_FORMATS.values())]


def run_fidelity(model: str | None, device: str, trust_remote_code: bool, path: Path,
                 quants: list[str], threads: int | None, target: Sink) -> None:
    """`bench --fidelity`: the text through float32 and each format; a table, or the
    document (docs/output.md)."""
    import torch

    from cli import output
    from genlib.backends.choose import stored_format
    from genlib.backends.fit import lean_of
    from genlib.backends.kernel import applies
    from genlib.lab.fidelity import fidelity

    text = read_fidelity_text(path)
    if threads is not None:
        torch.set_num_threads(threads)
    lm = load(ModelFlags(model, device, "float32", "none", trust_remote_code))
    lean = lean_of(lm)
    formats = fidelity_formats(quants)
    reasons = [applies(lean, name) for name in formats] if lean is not None else \
        ["it is not a model the lean forward runs"]
    if any(reasons):
        raise fail(f"--fidelity runs the native kernel, which cannot run {lm.ref} here: "
                   f"{next(r for r in reasons if r)}")
    tokens = lm.encode(text)
    if len(tokens) < 2:
        raise fail(f"--fidelity: {path} holds {len(tokens)} token(s); give a text of at "
                   f"least two tokens, the more the better (a few thousand)")
    stored = stored_format(lm)
    if stored:
        from cli.render import info

        info(f"{lm.ref} is stored in {stored}: float32 here is its dequantized weights")
    report = fidelity(lean, tokens, formats[1:], FIDELITY_WINDOW)
    rows = [r.to_dict() for r in report.values()]
    doc = output.document("bench", lm.ref, kind="fidelity", text=str(path),
                          tokens=len(tokens), window=FIDELITY_WINDOW,
                          machine={"threads": torch.get_num_threads()}, results=rows)
    target.json_document(doc)
    if not target.machine or not target.to_stdout:
        print_fidelity(rows)


def read_fidelity_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise fail(f"--fidelity: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise fail(f"--fidelity: {path} is not UTF-8 text (byte {exc.start}); give a text "
                   f"file") from None


def print_fidelity(rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from cli.render import out

    table = Table(show_edge=False)
    for column in ("weights", "perplexity", "vs float32", "top-1 agreement", "mean KL"):
        table.add_column(column, justify="left" if column == "weights" else "right")
    base = rows[0]["perplexity"]
    for r in rows:
        error = "" if r is rows[0] or r["perplexity_error"] is None else \
            f" ± {r['perplexity_error']:.2%}"
        table.add_row(r["weights"], f"{r['perplexity']:.3f}",
                      f"{r['perplexity'] / base - 1:+.2%}{error}", f"{r['top1_agreement']:.2%}",
                      f"{r['mean_kl']:.5f}")
    out.print(table)
    spread = "; ± one standard error over the windows of text" \
        if any(r["perplexity_error"] for r in rows) else ""
    out.print(f"{rows[0]['positions']:,} positions{spread};\nKL divergence in nats, from "
              f"float32's next-token distributions")


def run_sweep(model: str | None, device: str, trust_remote_code: bool, dtypes: list[str],
              quants: list[str], groups: list[list[Case]], runs: int, warmup: int,
              baseline: bool,
              threads: int | None, bandwidth: bool
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Load the model once per (dtype, quantization) and measure every case on it."""
    import torch

    from genlib.lab import bench as core

    if threads is not None:
        torch.set_num_threads(threads)
    machine: dict[str, Any] = {"threads": torch.get_num_threads(),
                               "read_bandwidth_gbs": None}
    probe = core.BandwidthProbe() if bandwidth else None
    records: list[dict[str, Any]] = []
    per_sweep = (sum(len(g) for g in groups) + (len(groups) if baseline else 0)) * \
        (warmup + runs)
    try:
        with progress_bar(len(dtypes) * len(quants) * per_sweep) as bar:
            _sweep(model, device, trust_remote_code, dtypes, quants, groups, runs, warmup,
                   baseline, bar, probe, records, machine)
    except KeyboardInterrupt:  # what was measured is reported, and marked so
        if not records:
            raise
        machine["interrupted"] = True
    if probe is not None and probe.samples:
        machine.update(bandwidth_summary(probe.samples))
    return records, machine


def _sweep(model: str | None, device: str, trust_remote_code: bool, dtypes: list[str],
           quants: list[str], groups: list[list[Case]], runs: int, warmup: int,
           baseline: bool, bar: Any, probe: Any, records: list[dict[str, Any]],
           machine: dict[str, Any]) -> None:
    """Every configuration's records, appended to `records` as each group finishes."""
    from genlib.lab import bench as core

    for dtype, quantize in product(dtypes, quants):
        lm = load(ModelFlags(model, device, dtype, quantize, trust_remote_code),
                  quick=False)
        core.check_cases(lm, [cases[0] for cases in groups])  # before any case runs
        bar.expect(forced_warmups(lm, groups, warmup))
        for cases in groups:
            group = core.measure(lm, cases, runs, warmup, baseline, bar, probe)
            for result in [*group.results, group.baseline]:
                if result is not None:
                    records.append(record(lm, dtype, quantize, result, group, runs,
                                          warmup))
                    machine.setdefault("weight_bytes", {})[weights_key(
                        records[-1])] = result.weight_bytes


def bandwidth_summary(samples: list[float]) -> dict[str, Any]:
    """The machine's read bandwidth over the samples taken between rounds, in GB/s."""
    import statistics

    gbs = [s / 1e9 for s in samples]
    return {"read_bandwidth_gbs": statistics.median(gbs), "read_bandwidth_gbs_min": min(gbs),
            "read_bandwidth_gbs_max": max(gbs), "bandwidth_samples": len(gbs)}


def forced_warmups(lm: LoadedModel, groups: list[list[Case]], warmup: int) -> int:
    """Warm-up runs beyond `warmup` that the cases need on `lm` (a compiled backend's)."""
    from genlib.lab import bench as core

    return sum(core.warmup_count(lm, core.Result(c, core.engine_name(c)), warmup) - warmup
               for cases in groups for c in cases)


class progress_bar:  # noqa: N801 - used as a context manager, like open()
    """A Rich progress bar on stderr; yields a tick() that advances it by one run, and
    whose expect(n) adds n runs to the total."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        from cli.render import err

        self._progress = Progress("measuring", BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=err, transient=True,
                                  disable=not err.is_terminal)  # nothing in logs
        self._task = self._progress.add_task("bench", total=total)

    def __enter__(self) -> Any:
        self._progress.start()
        return self

    def __call__(self) -> None:
        self._progress.advance(self._task)

    def expect(self, runs: int) -> None:
        total = self._progress.tasks[0].total or 0
        self._progress.update(self._task, total=total + runs)

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()


# --- Output -----------------------------------------------------------------------------

def emit(records: list[dict[str, Any]], machine: dict[str, Any], target: Sink,
         csv_path: str | None, plot: str | None, wide: bool) -> None:
    from cli import output, render

    doc = bench_json(records, machine)
    try:
        for record in doc["results"]:
            target.json_line(output.line(doc, record))
        target.json_document(doc)
        if not target.machine or not target.to_stdout:  # the table stays off a JSON stdout
            out = render.err if csv_path == "-" or target.machine else render.out
            print_table(records, machine, out, wide)
    finally:  # a reader of stdout that went away (| head) costs no export
        if csv_path is not None:
            write_csv(records, csv_path)
        if plot is not None:
            draw_plot(records, plot)
            render.info(f"plot written to {plot}")


def bench_json(records: list[dict[str, Any]], machine: dict[str, Any]) -> dict[str, Any]:
    """The document of the JSON contract: every record keeps its flat metrics (as in the
    CSV) and gains the shared `timings` and its strategy's `settings`."""
    from cli import output

    results = []
    for r in records:
        results.append({**r, "timings": output.timings(
            total_s=r["e2e_s"], prefill_s=r.get("prefill_s"), ttft_s=r["ttft_s"],
            tokens_per_s=r["decode_tps"])})
    models = list(dict.fromkeys(r["model"] for r in records))
    return output.document("bench", models[0] if len(models) == 1 else None, machine=machine,
                           results=results)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f}"


def _spread(r: dict[str, Any], key: str, fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(r[key])} [{fmt.format(r[key + '_min'])}-{fmt.format(r[key + '_max'])}]"


def _cells(r: dict[str, Any], wide: bool) -> dict[str, str]:
    """A record's cells by column name, in table order (the wide table's columns)."""
    cells = {
        "strategy": r["strategy"], "engine": engine_label(r, compile_time=wide),
        "dtype/quant": f"{r['torch_dtype']}/{r['quantize']}",
        "prompt/new/batch": f"{r['prompt_tokens']}/{r['new_tokens']}/{r['rows']}",
        "prefill tok/s": f"{r['prefill_tps']:,.0f}",
        "decode tok/s": _spread(r, "decode_tps") if wide else f"{r['decode_tps']:,.0f}",
        "ttft ms": _ms(r["ttft_s"]),
        "itl p50/p90/p99 ms": "/".join(_ms(r[f"itl_p{p}_s"]) for p in (50, 90, 99)),
        "e2e s": f"{r['e2e_s']:.3f}",
        "peak RSS MiB": "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:,.0f}",
        "speedup": "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
        "same tokens": {True: "yes", False: "NO", None: "-"}[r["identical_to_baseline"]],
        "% of bw bound": "-" if r["bound_fraction"] is None
        else f"{100 * r['bound_fraction']:.0f}%",
    }
    if wide:
        cells["decode tok/s [min-max]"] = cells.pop("decode tok/s")
        return {k: cells[k] for k in WIDE_COLUMNS}
    return {k: cells[k] for k in ("dtype/quant", *COLUMNS)}


# The default table: what a reader compares first, narrow enough for 80 columns with the
# usual labels (headers wrap, values never do). --wide adds the rest.
COLUMNS = ("strategy", "engine", "prompt/new/batch", "prefill tok/s", "decode tok/s",
           "ttft ms", "e2e s", "speedup", "% of bw bound")
WIDE_COLUMNS = ("strategy", "engine", "dtype/quant", "prompt/new/batch", "prefill tok/s",
                "decode tok/s [min-max]", "ttft ms", "itl p50/p90/p99 ms", "e2e s",
                "peak RSS MiB", "speedup", "same tokens", "% of bw bound")
TEXT_COLUMNS = ("strategy", "engine", "dtype/quant")
DROP_ORDER = ("prefill tok/s", "e2e s", "ttft ms", "prompt/new/batch")
SHORT_HEADERS = {"prompt/new/batch": "prompt/\nnew/batch", "prefill tok/s": "prefill\ntok/s",
                 "decode tok/s": "decode\ntok/s", "ttft ms": "ttft\nms", "e2e s": "e2e\ns",
                 "speedup": "speed-\nup", "% of bw bound": "% bw\nbound"}


def bench_table(records: list[dict[str, Any]], wide: bool = False,
                columns: tuple[str, ...] | None = None) -> Any:
    """The results table: one line per record, values never wrapped or cut."""
    from rich import box
    from rich.table import Table

    rows = [_cells(r, wide) for r in records]
    columns = columns or (WIDE_COLUMNS if wide else COLUMNS)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for name in columns:
        width = max([len(row[name]) for row in rows], default=1)
        header = name if wide else SHORT_HEADERS.get(name, name)
        table.add_column(header, justify="left" if name in TEXT_COLUMNS else "right",
                         no_wrap=True, min_width=width)
    for row in rows:
        table.add_row(*[row[name] for name in columns])
    return table


def natural_width(out: Any, renderable: Any) -> int:
    from rich.measure import Measurement

    return Measurement.get(out, out.options.update_width(10_000), renderable).maximum


def fitted_table(records: list[dict[str, Any]], width: int, out: Any
                 ) -> tuple[Any, list[str]]:
    """The default table within `width` columns: where even its columns do not fit (long
    labels, big numbers), the least telling ones go, named, rather than cut values."""
    columns = list(COLUMNS)
    if len({(r["torch_dtype"], r["quantize"]) for r in records}) > 1:  # what a sweep varies
        columns.insert(columns.index("engine") + 1, "dtype/quant")
    dropped: list[str] = []
    table = bench_table(records, columns=tuple(columns))
    for name in DROP_ORDER:
        if natural_width(out, table) <= width:
            break
        columns.remove(name)
        dropped.append(name)
        table = bench_table(records, columns=tuple(columns))
    return table, dropped


def print_table(records: list[dict[str, Any]], machine: dict[str, Any], out: Any,
                wide: bool = False) -> None:
    dropped: list[str] = []
    if wide:  # a report: at its natural width, never squeezed into the terminal's
        table = bench_table(records, wide=True)
        width = out.width
        out.width = max(width, natural_width(out, table))
        try:
            out.print(table, soft_wrap=False)
        finally:
            out.width = width
    else:
        table, dropped = fitted_table(records, out.width, out)
        out.print(table, soft_wrap=False)
    notes = [f"torch threads: {machine['threads']}"]
    if machine.get("read_bandwidth_gbs"):
        notes.append(f"read bandwidth: {machine['read_bandwidth_gbs']:.1f} GB/s, median of "
                     f"{machine['bandwidth_samples']} samples between rounds "
                     f"[{machine['read_bandwidth_gbs_min']:.1f}-"
                     f"{machine['read_bandwidth_gbs_max']:.1f}]")
        for key, weights in machine.get("weight_bytes", {}).items():
            if not weights:
                continue
            bound = machine["read_bandwidth_gbs"] * 1e9 / weights
            notes.append(f"weights {key}: {weights / 1e6:.1f} MB read per step -> bound "
                         f"{bound:,.0f} tok/s at batch 1 at that median (each row's % uses "
                         f"its own configuration's samples)")
    if dropped:
        notes.append(f"too narrow for: {', '.join(dropped)}")
    if not wide:
        notes.append("--wide shows every column")
    from rich.text import Text

    out.print(Text(" · ".join(notes), style="dim", no_wrap=False), soft_wrap=False)


CSV_SKIP = ("settings",)  # nested: the JSON has it; a CSV cell would hold a dict's repr


# More torch threads than this many per logical CPU only contend, and each one costs
# memory and start-up time: a typo (--threads 2000) is refused before the sweep.
THREADS_PER_CPU = 4


def check_threads(threads: int | None) -> None:
    cpus = os.cpu_count() or 1
    if threads is not None and threads > THREADS_PER_CPU * cpus:
        raise fail(f"--threads {threads} is more than {THREADS_PER_CPU} per logical CPU of "
                   f"this machine ({cpus} CPUs: at most {THREADS_PER_CPU * cpus}); pass a "
                   f"count up to {cpus} to use every CPU")


def write_csv(records: list[dict[str, Any]], path: str) -> None:
    fields = [k for k in records[0] if k not in CSV_SKIP] if records else []
    try:
        handle = sys.stdout if path == "-" else open(path, "w", newline="")  # noqa: SIM115
    except OSError as exc:  # checked before the sweep, but a long sweep gives time to change
        raise fail(f"--csv: cannot write {path}: {exc.strerror or exc} (the other outputs "
                   f"are written); pick a writable path") from None
    try:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    finally:
        if handle is not sys.stdout:
            handle.close()


def swept_variable(records: list[dict[str, Any]]) -> str:
    """The first setting that takes more than one value (else new_tokens)."""
    keys = {"prompt_len": "prompt_len", "new_tokens": "new_tokens_requested",
            "batch_size": "batch_size", "dtype": "dtype", "quantize": "quantize"}
    for name in SWEPT:
        if len({r[keys[name]] for r in records}) > 1:
            return keys[name]
    return "new_tokens_requested"


def draw_plot(records: list[dict[str, Any]], path: str) -> None:
    """Decode tokens/s against the swept variable, one line per strategy and engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = swept_variable(records)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[str, list[tuple[Any, float]]] = {}
    for r in records:
        lines.setdefault(f"{r['strategy']} / {r['engine']}", []).append(
            (r[x_key], r["decode_tps"]))
    for label, points in lines.items():
        xs = [str(x) for x, _ in points] if isinstance(points[0][0], str) else \
            [x for x, _ in points]
        ax.plot(xs, [y for _, y in points], marker="o", label=label)
    ax.set_xlabel(x_key.replace("_requested", "").replace("_", " "))
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"genlab bench: {records[0]['model']}" if records else "genlab bench")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise fail(f"--plot: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
