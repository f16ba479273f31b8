"""`genlab compare`: one prompt through several decoding strategies, side by side.

The view fills in live, one column per strategy on a terminal at least 120 columns wide
(a table per row of strategies where they do not all fit; stacked panels on a narrower
terminal and in a pipe), then shows each strategy's metrics with the best value of each
highlighted and starred. `--json`
and `--markdown` export the whole comparison. `--models` / `--quantize` compare models
or quantizations on one strategy instead. `--logprobs N` adds each output's tokens'
logprobs: a table per output under the view (the columns have no room for N
alternatives per token), the OpenAI/vLLM object per output in the JSON.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import options as opt
from cli.context import ModelFlags
from cli.errors import INTERRUPTED, fail, user_errors
from cli.output import Sink, opened, sink

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from genlib.lab.compare import Comparison, ModelComparison, Strategy, StrategyResult
    from genlib.models.info import LoadedModel
    from genlib.settings.config import GenerationSettings


SIDE_BY_SIDE = 120  # a terminal this wide or wider shows the strategies in columns
MIN_COLUMN = 30  # characters a text column needs to stay readable: sets columns per row
REFRESH_S = 0.1  # live view redraws at most this often (Rich is slow on a busy CPU)
LABEL_WIDTH = 20
SUMMARY_SKIP = ("seed", "do_sample", "strategy", "max_new_tokens", "min_new_tokens",
                "ignore_eos", "stop_strings", "max_time", "num_return_sequences",
                "json_schema", "regex", "grammar")


# --- shared formatting --------------------------------------------------------------

def settings_summary(settings: GenerationSettings) -> str:
    """The settings that make a column what it is: its strategy, then every setting
    that differs from the built-in default (run-wide ones such as the seed left out)."""
    from genlib.settings.config import GenerationSettings

    # Compared in to_dict()'s form on both sides: the default logit_bias is the empty
    # tuple in SPECS but `{}` in a dict, and an empty bias is no change.
    defaults = GenerationSettings().to_dict()
    changed = [f"{key}={value}" for key, value in settings.to_dict().items()
               if key not in SUMMARY_SKIP and value != defaults[key]]
    return " ".join([settings.strategy, *changed])


def wrapped(markup: str) -> Any:
    """Rich markup as a Text that wraps: the consoles soft-wrap (for streamed text), which
    would otherwise crop a long cell to one line of its column."""
    from rich.text import Text

    text = Text.from_markup(markup)
    text.no_wrap, text.overflow = False, "fold"
    return text


def format_metric(key: str, value: float | None) -> str:
    from genlib.lab.metrics import METRICS

    if value is None:
        return "-"
    fmt = next(m.fmt for m in METRICS if m.key == key)
    return format(value, fmt)


def metric_text(result: StrategyResult, key: str) -> str:
    """A strategy's metric as shown: new tokens as an integer where every sample has the
    same count (a mean like 48.0 reads as a fraction of a token), else as formatted."""
    value = result.metrics.get(key)
    if key == "new_tokens" and value is not None:
        counts = {len(sample.token_ids) for sample in result.samples}
        if len(counts) == 1:
            return str(counts.pop())
    return format_metric(key, value)


def metric_cell(key: str, value: float | None, best: dict[str, float],
                text: str | None = None) -> str:
    """A metric's cell (`text`, else its formatted value), starred where it is the best
    of its row."""
    text = format_metric(key, value) if text is None else text
    if value is not None and key in best and value == best[key]:
        return f"[bold green]{text} *[/]"  # the star survives where colour does not
    return text


def best_legend() -> str:
    """What the * beside a metric means (set by `metric_cell`, from genlib.lab.metrics)."""
    from genlib.lab.metrics import METRICS

    higher = [m.label for m in METRICS if m.higher_is_better]
    lower = [m.label for m in METRICS if m.higher_is_better is False]
    return (f"* the best value of its row, among the strategies that ran to the end: "
            f"highest {', '.join(higher)}; lowest {', '.join(lower)}")


# --- the live view ------------------------------------------------------------------

class View:
    """What the terminal shows: the texts so far and, once done, each column's metrics."""

    def __init__(self, strategies: list[Strategy], prompt: str = "") -> None:
        self.strategies = strategies
        self.prompt = prompt
        self.texts: list[dict[int, str]] = [{} for _ in strategies]
        self.results: list[StrategyResult | None] = [None for _ in strategies]
        self.running: int | None = None

    @property
    def done(self) -> list[StrategyResult]:
        """The results of the strategies that ran, in order."""
        return [r for r in self.results if r is not None]

    def on_event(self, index: int, event: Any) -> None:
        from genlib.events import Finish, Token
        from genlib.lab.compare import StrategyDone

        self.running = index
        if isinstance(event, Token):
            texts = self.texts[index]
            texts[event.row] = texts.get(event.row, "") + event.text
        elif isinstance(event, Finish):
            self.texts[index][event.row] = event.text
        elif isinstance(event, StrategyDone):
            self.results[index] = event.result
            if event.result.samples:  # the final texts (a decoder may stream no tokens)
                self.texts[index] = dict(enumerate(s.text for s in event.result.samples))
            self.running = None

    def best(self) -> dict[str, float]:
        from genlib.lab.metrics import best_values

        # A column Ctrl-C cut short is shown, but its metrics (fewer tokens) compete with none.
        return best_values([r.metrics for r in self.results
                            if r and r.error is None and not r.interrupted])

    def body(self, index: int) -> RenderableType:
        """A column's text: its samples, one after the other, or its error."""
        from rich.markup import escape
        from rich.text import Text

        result = self.results[index]
        if result is not None and result.error is not None:
            return wrapped(f"[red]error:[/] {escape(result.error)}")
        texts = self.texts[index]
        if not texts:
            return Text("generating…" if self.running == index else "waiting…", style="dim")
        # Wrapped in full: the console's soft_wrap (kept for streamed text) would crop
        # each text to one line of its column.
        body = Text(no_wrap=False, overflow="fold")
        for n, row in enumerate(sorted(texts)):
            if n:
                body.append(f"\n── sample {n + 1} ──\n", style="dim")
            body.append(texts[row])
        if self.running == index:
            body.append("▌", style="dim")
        return body

    def header(self, index: int) -> str:
        """The strategy's label and, on a second line, its settings where they say more."""
        summary = self.summary(index)
        return self.label(index) if summary is None else f"{self.label(index)}\n{summary}"

    def label(self, index: int) -> str:
        from rich.markup import escape

        result = self.results[index]
        cut = " [yellow](interrupted)[/]" if result is not None and result.interrupted else ""
        return f"[bold]{escape(self.strategies[index].label)}[/]{cut}"

    def summary(self, index: int) -> str | None:
        """The settings that make the strategy what it is, unless its label says it."""
        from rich.markup import escape

        strategy = self.strategies[index]
        summary = settings_summary(strategy.settings)
        if summary in (strategy.label, strategy.label.replace("-", "_")):
            return None
        return f"[dim]{escape(summary)}[/]"

    def render(self, width: int, terminal: bool = True) -> RenderableType:
        """Side by side on a terminal at least SIDE_BY_SIDE columns wide; stacked panels
        on a narrower one, and in a pipe (`terminal` False), which reads one strategy at
        a time."""
        if not terminal or width < SIDE_BY_SIDE:
            return self.stacked()
        return self.side_by_side(width)

    def side_by_side(self, width: int) -> RenderableType:
        """A table of columns per row of strategies: as many columns as fit MIN_COLUMN
        each beside the labels, the strategies spread evenly over the fewest rows
        (six at 160 columns: two rows of three)."""
        from rich.console import Group

        n = len(self.strategies)
        per_row = max(1, (width - LABEL_WIDTH) // MIN_COLUMN)
        rows = -(-n // per_row)
        size = -(-n // rows)
        tables = [self.table(range(first, min(first + size, n))) for first in range(0, n, size)]
        return Group(*tables, *self.footer())

    def table(self, indices: range) -> RenderableType:
        """One column per strategy of `indices`; metric rows under the texts."""
        from rich.table import Table

        from genlib.lab.metrics import METRICS

        table = Table(expand=True)
        table.add_column("", style="dim", width=LABEL_WIDTH, no_wrap=True)
        for index in indices:  # labels alone, so that they share a line
            table.add_column(wrapped(self.label(index)), ratio=1, overflow="fold")
        summaries = [self.summary(i) for i in indices]
        if any(summaries):
            table.add_row("settings", *[wrapped(s or "") for s in summaries])
        table.add_row("output", *[self.body(i) for i in indices], end_section=True)
        best = self.best()
        if self.has_metrics():
            for metric in METRICS:
                table.add_row(metric.label, *[self._metric(i, metric.key, best) for i in indices])
        return table

    def has_metrics(self) -> bool:
        return any(r is not None and r.error is None for r in self.results)

    def footer(self) -> list[RenderableType]:
        """What the * means (once there are metrics), then the prompt."""
        from rich.markup import escape

        lines = [f"[dim]{best_legend()}[/]"] if self.has_metrics() else []
        if self.prompt:
            lines.append(f"[dim]prompt:[/] {escape(self.prompt)}")
        return [wrapped(line) for line in lines]

    def _metric(self, index: int, key: str, best: dict[str, float]) -> str:
        result = self.results[index]
        if result is None or result.error is not None:
            return ""
        return metric_cell(key, result.metrics.get(key), best, metric_text(result, key))

    def stacked(self) -> RenderableType:
        """One panel per strategy, for terminals too narrow for side-by-side columns."""
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        from genlib.lab.metrics import METRICS

        best = self.best()
        panels = []
        for index in range(len(self.strategies)):
            parts: list[RenderableType] = [self.body(index)]
            result = self.results[index]
            if result is not None and result.error is None:
                grid = Table.grid(padding=(0, 2))
                parts.append(Text(""))
                for metric in METRICS:
                    grid.add_row(f"[dim]{metric.label}[/]",
                                 metric_cell(metric.key, result.metrics.get(metric.key), best,
                                             metric_text(result, metric.key)))
                parts.append(grid)
            panels.append(Panel(Group(*parts),
                                title=self.header(index).replace("\n", " · "),
                                title_align="left"))
        return Group(*panels, *self.footer())


def console_for(target: Sink, markdown_path: str | None) -> Console:
    """The view goes to stdout without --json/--jsonl and --markdown -; otherwise to
    stderr, so stdout holds the JSON or the Markdown only (and with -o FILE, nothing)."""
    from cli import render

    on_stderr = target.machine or markdown_path == "-"
    return render.err if on_stderr else render.out


def run_live(lm: Any, prompt: str, prompt_ids: list[int], strategies: list[Strategy],
             crn: bool, console: Console, logprobs: int = 0, backend: str = "auto"
             ) -> tuple[View, bool]:
    """Run every strategy on the user's `backend`, redrawing the view as tokens arrive
    on a terminal (piped, the caller prints it once, as it ended). Return the view,
    whose `done` are the strategies that ran, and whether Ctrl-C hit."""
    from rich.live import Live

    from genlib.lab.compare import StrategyDone, comparison_events

    view = View(strategies, prompt)
    interrupted = False
    live = Live(console=console, auto_refresh=False, transient=False) \
        if console.is_terminal else None
    last_draw = 0.0
    if live is not None:
        live.start()
    try:
        for index, event in comparison_events(lm, prompt_ids, strategies, crn, logprobs,
                                              backend):
            view.on_event(index, event)
            now = time.perf_counter()
            if live is not None and (isinstance(event, StrategyDone)
                                     or now - last_draw >= REFRESH_S):
                live.update(view.render(console.width), refresh=True)
                last_draw = now
    except KeyboardInterrupt:  # while the view was drawn, between events
        interrupted = True
    finally:
        if live is not None:
            live.update(view.render(console.width), refresh=True)
            live.stop()
    return view, interrupted or any(r.interrupted for r in view.done)


# --- exports ------------------------------------------------------------------------

CRN_NOTE = ("common random numbers: every sampled strategy draws from the same uniform "
            "per step (inverse CDF), so differences come from the settings (--no-crn: "
            "independent draws)")
NO_CRN_NOTE = "independent random draws per strategy (--no-crn): part of the differences is luck"


def _constraint_markdown(settings: GenerationSettings) -> list[str]:
    """The strategy's JSON schema, regex or grammar, whole (the settings line leaves it
    out for brevity); nothing without one."""
    for key, name in (("json_schema", "JSON schema"), ("regex", "Regex"),
                      ("grammar", "Grammar (EBNF)")):
        text = getattr(settings, key, None)
        if text is not None:
            fence = "```" + "`" * max((len(m) for m in re.findall(r"`+", text)), default=0)
            return [f"{name}:", "", fence, text, fence, ""]
    return []


def comparison_markdown(comparison: Comparison) -> str:
    """The whole comparison as Markdown: a metrics table (best in bold), then each
    strategy's settings and samples."""
    from genlib.lab.metrics import METRICS, best_values

    results = comparison.results
    best = best_values([r.metrics for r in results if r.error is None and not r.interrupted])
    lines = ["# genlab compare", "",
             f"- model: `{comparison.model}`",
             f"- prompt: `{_md_inline(comparison.prompt)}` ({comparison.prompt_tokens} tokens)",
             f"- seed: {comparison.seed}",
             f"- random draws: {'common to every strategy' if comparison.crn else 'independent'}",
             "",
             "## Metrics", "",
             f"In bold, {best_legend().removeprefix('* ')}.", "",
             "| metric | " + " | ".join(_md_cell(r.strategy.label) for r in results) + " |",
             "| --- |" + " ---: |" * len(results)]
    for metric in METRICS:
        cells = []
        for r in results:
            value = r.metrics.get(metric.key) if r.error is None else None
            text = metric_text(r, metric.key) if r.error is None else "error"
            bold = value is not None and best.get(metric.key) == value
            cells.append(f"**{text}**" if bold else text)
        lines.append(f"| {metric.label} | " + " | ".join(cells) + " |")
    for r in results:
        cut = " (interrupted)" if r.interrupted else ""
        lines += ["", f"## {r.strategy.label}{cut}", "",
                  f"Settings: `{settings_summary(r.strategy.settings)}`", ""]
        lines += _constraint_markdown(r.strategy.settings)
        if r.error is not None:
            lines += [f"Error: {r.error}"]
            continue
        for n, sample in enumerate(r.samples):
            lines += [f"### sample {n + 1} ({sample.reason}, {len(sample.token_ids)} tokens)",
                      "", *fenced(sample.text), ""]
    return "\n".join(lines).rstrip() + "\n"


def models_markdown(comparison: ModelComparison) -> str:
    lines = ["# genlab compare (models)", "",
             f"- prompt: `{_md_inline(comparison.prompt)}`",
             f"- strategy: {comparison.strategy.label} "
             f"(`{settings_summary(comparison.strategy.settings)}`)", "",
             "| model | tokens/s | time (s) | weights | peak memory | first difference "
             "| agreement |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in comparison.runs:
        cells = model_cells(run)
        lines.append(f"| {_md_cell(run.label)} | " + " | ".join(cells) + " |")
    for run in comparison.runs:
        cut = " (interrupted)" if run.interrupted else ""
        lines += ["", f"## {run.label}{cut}", ""]
        lines += [f"Error: {run.error}"] if run.error else fenced(run.text)
    return "\n".join(lines).rstrip() + "\n"


def fenced(text: str) -> list[str]:
    """`text` as a fenced code block whose fence is longer than any run of backticks in
    it (CommonMark's rule), so generated code that writes ``` cannot close it early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}text", text, fence]


def _md_inline(text: str) -> str:
    return text.replace("`", "'").replace("\n", "\\n")


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_export(path: str, text: str) -> None:
    """Write an export to a file, or to stdout for `-`."""
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise fail(f"cannot write {path}: {exc.strerror}; pick a writable path") from None


def sample_output(index: int, sample: Any) -> dict[str, Any]:
    """A strategy's sample as an output of the JSON contract (with --logprobs, its
    `logprobs` object as generate writes it)."""
    from cli import output

    tps = len(sample.token_ids) / sample.seconds if sample.seconds > 0 else None
    return output.output(index, sample.text, sample.token_ids, sample.reason,
                         output.timings(total_s=sample.seconds, tokens_per_s=tps),
                         token_logprobs=[round(lp, 6) for lp in sample.logprobs],
                         score=sample.score, **logprobs_key(sample.logprobs_object))


def logprobs_key(logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """An output's `logprobs` key, where the run recorded the object."""
    return {} if logprobs is None else {"logprobs": logprobs}


def comparison_json(comparison: Comparison) -> dict[str, Any]:
    """The strategies comparison as one document of the JSON contract."""
    from cli import output

    data = comparison.to_dict()
    strategies = []
    for result, entry in zip(comparison.results, data["strategies"]):
        del entry["samples"]
        entry["outputs"] = [sample_output(n, s) for n, s in enumerate(result.samples, 1)]
        strategies.append(entry)
    return output.document("compare", comparison.model, kind="strategies",
                           prompt=comparison.prompt, prompt_tokens=comparison.prompt_tokens,
                           seed=comparison.seed, random_draws=data["random_draws"],
                           metrics=data["metrics"], best=data["best"], strategies=strategies)


def models_json(comparison: ModelComparison) -> dict[str, Any]:
    """The models comparison as one document: each run with its model and output."""
    from cli import output

    data = comparison.to_dict()
    runs = []
    for run, entry in zip(comparison.runs, data["runs"]):
        for key in ("text", "token_ids", "seconds", "tokens_per_s", "finish_reason"):
            del entry[key]
        entry["outputs"] = [] if run.error or run.finish_reason is None else [output.output(
            1, run.text, run.token_ids, run.finish_reason,
            output.timings(total_s=run.seconds, tokens_per_s=run.tokens_per_s),
            **logprobs_key(run.logprobs_object))]
        runs.append(entry)
    return output.document("compare", None, kind="models", prompt=comparison.prompt,
                           strategy=data["strategy"], settings=data["settings"],
                           interrupted=data["interrupted"], runs=runs)


def emit(doc: dict[str, Any], groups: str, target: Sink, markdown: str,
         markdown_path: str | None) -> None:
    """The document (--json), its outputs line by line (--jsonl, each with the settings
    and label of its strategy, or the model of its run) and the Markdown export."""
    from cli import output

    try:
        for group in doc[groups]:
            label = {"strategy": group["label"]} if "label" in group else {
                "model": group["model"], "quantize": group["quantize"]}
            settings = {"settings": group["settings"]} if "settings" in group else {}
            for out in group["outputs"]:
                target.json_line(output.line(doc, out, **label, **settings))
        target.json_document(doc)
    finally:  # a reader of stdout that went away (| head -1) costs no export
        if markdown_path:
            write_export(markdown_path, markdown)


# --- --logprobs in the terminal view -----------------------------------------------

BEAM_NOTE = ("--logprobs: beam search records no per-token detail, so beam outputs get no "
             "logprobs (their --json still lists the raw model's token_logprobs)")


def logprobs_tables(tables: list[tuple[str, dict[str, Any], GenerationSettings]],
                    console: Console) -> None:
    """One --logprobs table per (title, logprobs object, the settings that made it),
    under the comparison."""
    from cli.render_tokens import logprobs_title, logprobs_view

    for title, logprobs, settings in tables:
        console.print(logprobs_view(logprobs, f"{title} · {logprobs_title(settings)}"))


def strategy_tables(results: list[StrategyResult]
                    ) -> list[tuple[str, dict[str, Any], GenerationSettings]]:
    """(title, logprobs object, settings) of every output that has one: the strategy's
    label, and the sample's number where the strategy drew several."""
    tables = []
    for result in results:
        several = len(result.samples) > 1
        for n, sample in enumerate(result.samples, 1):
            if sample.logprobs_object is not None:
                title = f"{result.strategy.label} · sample {n}" if several \
                    else result.strategy.label
                tables.append((title, sample.logprobs_object, result.strategy.settings))
    return tables


# --- comparing models / quantizations -----------------------------------------------

def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def model_cells(run: Any) -> list[str]:
    """tokens/s, time, weights, peak memory, first difference, agreement."""
    if run.error:
        return ["error"] * 6
    first = "identical" if run.first_difference is None else f"{run.unit} {run.first_difference}"
    agree = "-" if run.agreement is None else f"{run.agreement:.1%}"
    tps = "-" if run.tokens_per_s is None else f"{run.tokens_per_s:.1f}"
    return [tps, f"{run.seconds:.2f}", _bytes(run.weight_bytes), _bytes(run.peak_bytes),
            first, agree]


def models_table(comparison: ModelComparison) -> RenderableType:
    from rich.markup import escape
    from rich.table import Table

    strategy = comparison.strategy
    summary = settings_summary(strategy.settings)
    title = strategy.label if summary == strategy.label else f"{strategy.label}: {summary}"
    table = Table(expand=True, title=escape(title),
                  caption=f"[dim]* the fastest tokens/s and the smallest weights\nprompt:[/] "
                  f"{escape(comparison.prompt)}", caption_justify="left")
    table.add_column("", style="dim", width=LABEL_WIDTH, no_wrap=True)
    for run in comparison.runs:
        table.add_column(f"[bold]{escape(run.label)}[/]", ratio=1, overflow="fold")
    table.add_row("output", *[wrapped(output_cell(r)) for r in comparison.runs],
                  end_section=True)
    ok = [r for r in comparison.runs if not r.error]
    fastest = max((r.tokens_per_s or 0 for r in ok), default=None)
    smallest = min((r.weight_bytes for r in ok if r.weight_bytes), default=None)
    labels = ["tokens/s", "time (s)", "weights", "peak memory", "first difference",
              "agreement"]
    columns = [model_cells(r) for r in comparison.runs]
    for row, label in enumerate(labels):
        cells = []
        for run, col in zip(comparison.runs, columns):
            best = (row == 0 and not run.error and run.tokens_per_s == fastest) or \
                (row == 2 and not run.error and run.weight_bytes == smallest)
            cells.append(f"[bold green]{col[row]} *[/]" if best else col[row])
        table.add_row(label, *cells)
    return table


def output_cell(run: Any) -> str:
    """A model run's text, its error, or its text marked as cut short by Ctrl-C."""
    from rich.markup import escape

    if run.error:
        return f"[red]error:[/] {escape(run.error)}"
    if run.interrupted:
        return f"{escape(run.text)} [yellow](interrupted)[/]"
    return escape(run.text)


def run_models(prompt: str, strategies: list[Strategy], model_refs: list[str],
               quantizations: list[str], flags: ModelFlags, target: Sink,
               markdown_path: str | None, logprobs: int = 0) -> None:
    from cli import render
    from genlib.lab.compare import compare_models
    from genlib.models.loading import ModelSpec, resolve_model_ref

    if len(strategies) != 1:
        raise fail(f"--models/--quantize compare one strategy, got {len(strategies)}; "
                   f"give exactly one -p or --variant (default: greedy)")
    refs = model_refs or [resolve_model_ref(flags.model)]
    specs = [ModelSpec(ref, flags.device, flags.dtype, q, flags.trust_remote_code,
                       flags.backend) for ref in refs for q in quantizations]
    render.info(f"comparing {len(specs)} model runs, one at a time…")
    if logprobs and strategies[0].settings.strategy == "beam":
        render.info(BEAM_NOTE)
    comparison = compare_models(specs, prompt, strategies[0], logprobs, freeze=True)
    console = console_for(target, markdown_path)
    try:
        console.print(models_table(comparison))
        if not target.machine:
            logprobs_tables([(run.label, run.logprobs_object, strategies[0].settings)
                             for run in comparison.runs if run.logprobs_object is not None],
                            console)
    finally:  # a reader of the table that went away (| head) costs no export
        emit(models_json(comparison), "runs", target, models_markdown(comparison),
             markdown_path)
    if comparison.interrupted:
        raise fail("interrupted: the table shows the runs so far", INTERRUPTED)
    if all(r.error for r in comparison.runs):
        raise fail(f"every model run failed: {comparison.runs[0].error}")
    budget = strategies[0].settings.max_new_tokens
    if warn_invalid([(budget, run.finish_reason) for run in comparison.runs
                     if run.finish_reason is not None]):
        raise typer.Exit(1)  # as generate: an output is not valid under its grammar


# --- the command --------------------------------------------------------------------

Variants = Annotated[list[str] | None, typer.Option(
    "--variant", rich_help_panel=opt.DECODING_PANEL,
    help="An ad-hoc strategy, e.g. \"temperature=0.7,top_p=0.9\" (repeatable).")]
Samples = Annotated[int, typer.Option(
    "--samples", rich_help_panel=opt.DECODING_PANEL,
    help="Outputs drawn for each stochastic strategy.")]
Models = Annotated[str | None, typer.Option(
    "--models", rich_help_panel=opt.MODEL_PANEL,
    help="Compare models on one strategy: comma-separated hub ids or folders.")]
Quantizations = Annotated[str, typer.Option(
    "--quantize", rich_help_panel=opt.MODEL_PANEL,
    help="none, 8bit or 4bit; comma-separated to compare quantizations.")]
MarkdownPath = Annotated[str | None, typer.Option(
    "--markdown", rich_help_panel=opt.OUTPUT_PANEL, metavar="PATH",
    help="Export the comparison as Markdown to PATH (`-` for stdout).")]


@user_errors
@opt.options(("model", ("max_new_tokens", "min_new_tokens", "stop_strings", "seed",
                        "max_time", "ignore_eos") + opt.CONSTRAINTS))
def compare(
    prompt: opt.Prompt = None,
    preset: opt.Presets = None,
    variant: Variants = None,
    samples: Samples = 1,
    model: opt.Model = None,
    models: Models = None,
    quantize: Quantizations = "none",
    as_json: opt.Json = False,
    as_jsonl: opt.Jsonl = False,
    output: opt.OutputFile = None,
    markdown_path: MarkdownPath = None,
    logprobs: opt.Logprobs = None,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    trust_remote_code: opt.TrustRemoteCode = False,
    backend: opt.Backend = "auto",
    ensemble: opt.Ensemble = None,
    amateur: opt.Amateur = None,
    crn: Annotated[bool, typer.Option(
        "--crn/--no-crn", rich_help_panel=opt.DECODING_PANEL,
        help="Common random numbers: every sampled strategy uses the same uniform draw "
        "per step (inverse-CDF sampling), so columns differ by their settings, not by "
        "luck; --no-crn draws independently.")] = True,
    **given: Any,
) -> None:
    """Run one prompt through several decoding strategies and show them side by side.

    Default set: greedy, beam (4 beams), top-k 40, top-p 0.9, temperature 0.5 and 1.3.

    Examples:\n
      genlab compare "Once upon a time" -m ../shared/models/stories260K -n 200\n
      genlab compare "Once upon a time" -p greedy -p creative --variant "repetition_penalty=1.3"\n
      genlab compare "def add(a, b):" --samples 3 --seed 1 --json -o out.json\n
      genlab compare "Once upon a time" --models MODEL_A,MODEL_B
    """
    from cli.context import presets_model, read_prompt
    from genlib.lab.compare import build_strategies, sharing_seed, strategy_from_variant
    from genlib.settings.config import fresh_seed

    target = sink(as_json, as_jsonl, output)
    check_outputs(target, markdown_path)
    if model is not None and models is not None:
        raise fail("-m/--model and --models exclude each other: give every model to "
                   "--models (comma-separated), or one with -m")
    presets = opt.preset_refs(preset)
    flags = opt.given_settings(given, prompt)
    base_seed = flags["seed"] if "seed" in flags else fresh_seed()
    strategies = sharing_seed(build_strategies(presets, variant or [], flags, samples),
                              base_seed)
    text = read_prompt(prompt)
    if model is None and models is None:
        model = presets_model(presets, ", or compare them with --models")
    model_flags = ModelFlags(model, device, dtype, "none", trust_remote_code, backend,
                             tuple(ensemble or ()), amateur)
    check_combined(strategies, model_flags, models is not None)
    model_refs, quantizations = opt.comma_list(models), opt.comma_list(quantize)
    if models is not None and not model_refs:
        raise fail("--models names no model; give comma-separated hub ids or folders, e.g. "
                   "--models MODEL_A,MODEL_B")
    if not quantizations:
        raise fail("--quantize names no quantization; give a comma list of none, 8bit, 4bit")
    if len(model_refs) > 1 or len(quantizations) > 1:
        if not presets and not variant:
            greedy = strategy_from_variant("strategy=greedy", flags, label="greedy")
            strategies = sharing_seed([greedy], base_seed)
        if samples > 1:
            raise fail("--samples applies to comparing strategies, not --models/--quantize")
        with opened(target):
            run_models(text, strategies, model_refs, quantizations, model_flags, target,
                       markdown_path, logprobs or 0)
        return
    model_flags.model = model_refs[0] if model_refs else model
    model_flags.quantize = quantizations[0]
    with opened(target):
        run_strategies(text, strategies, model_flags, base_seed, target, markdown_path, crn,
                       logprobs or 0)


def check_combined(strategies: list[Strategy], model_flags: ModelFlags, models: bool
                   ) -> None:
    """Input errors, before any model loads, where the strategies and the combined
    models do not meet: --ensemble and --amateur serve the strategies that set
    ensemble_mode or cd_beta (the `cd` preset), on -m's model, and those need them."""
    from cli.context import combination_defaults

    combination_defaults(model_flags, {})  # a bad weight, or both at once
    if models and model_flags.combined:
        raise fail("--ensemble and --amateur combine models with -m's; they do not apply "
                   "to --models")
    wants = {"--ensemble": [s.label for s in strategies
                            if s.settings.ensemble_mode is not None],
             "--amateur": [s.label for s in strategies if s.settings.cd_beta is not None]}
    given = {"--ensemble": bool(model_flags.ensemble), "--amateur": bool(model_flags.amateur)}
    needs = {"--ensemble": "ensemble_mode (--variant ensemble_mode=mean)",
             "--amateur": "cd_beta (the cd preset: -p cd)"}
    for flag, labels in wants.items():
        if labels and not given[flag]:
            raise fail(f"strategy {labels[0]!r} combines models: give {flag} MODEL")
        if given[flag] and not labels:
            raise fail(f"{flag} serves the strategies that set {needs[flag]}; no strategy "
                       f"does")


def check_outputs(target: Sink, markdown_path: str | None) -> None:
    """Refuse outputs that collide or that -o cannot write."""
    if target.machine and target.to_stdout and markdown_path == "-":
        raise fail(f"--{target.mode} and --markdown - both want stdout; write one of them to "
                   f"a file (-o FILE or --markdown FILE)")
    if markdown_path not in (None, "-") and not target.to_stdout \
            and Path(markdown_path).resolve() == Path(target.path or "").resolve():
        raise fail(f"-o and --markdown both name {markdown_path}; the Markdown would "
                   f"overwrite the {target.mode.upper()}: give them different files")
    if markdown_path is not None and markdown_path != "-":
        from cli.paths import check_output_path

        check_output_path(Path(markdown_path), "--markdown")


def prepare_grammars(lm: LoadedModel, strategies: list[Strategy]) -> None:
    """Each distinct grammar of the strategies compiled before any column's clock starts
    (as generate prepares its one; the first column to use it paid for the compile). One
    that every strategy shares and that cannot be compiled ends the comparison in one
    line, as it ends generate; another is left for its columns to report."""
    from cli.context import prepare_grammar
    from genlib.errors import GenlabError
    from genlib.sampling import grammar

    def constraint(strategy: Strategy) -> tuple[str, Any] | None:
        kind = grammar.kind_of(strategy.settings)
        return None if kind is None else (kind, getattr(strategy.settings, kind))

    tried: set[tuple[str, Any]] = set()
    for strategy in strategies:
        key = constraint(strategy)
        if key is None or key in tried:
            continue
        tried.add(key)
        try:
            prepare_grammar(lm, strategy.settings)
        except GenlabError:
            if all(constraint(other) == key for other in strategies):
                raise


def run_strategies(text: str, strategies: list[Strategy], model_flags: ModelFlags,
                   seed: int, target: Sink, markdown_path: str | None,
                   crn: bool = True, logprobs: int = 0) -> None:
    from cli import render
    from cli.context import load
    from genlib.lab.compare import Comparison

    lm = load(model_flags)
    # Refused before tokenizing when no strategy could fit it (each still checks its own).
    least = min((s.settings.max_new_tokens for s in strategies), default=1)
    lm.check_prompt_chars(text, least)
    ids = lm.encode(text)
    prepare_grammars(lm, strategies)
    console = console_for(target, markdown_path)
    if any(s.stochastic for s in strategies):
        render.info(CRN_NOTE if crn else NO_CRN_NOTE)
    if logprobs and any(s.settings.strategy == "beam" for s in strategies):
        render.info(BEAM_NOTE)
    view, interrupted = run_live(lm, text, ids, strategies, crn, console, logprobs,
                                 model_flags.backend)
    results = view.done
    comparison = Comparison(model=lm.ref, prompt=text, prompt_tokens=len(ids), seed=seed,
                            results=results, crn=crn)
    try:
        if not console.is_terminal:  # piped: the view once, as it ended
            console.print(view.render(console.width, terminal=False))
        if not target.machine:
            logprobs_tables(strategy_tables(results), console)
    finally:  # a reader of the view that went away (| head) costs no export
        for result in results:
            if result.error is not None:
                render.warn(f"{result.strategy.label}: {result.error}")
        emit(comparison_json(comparison), "strategies", target,
             comparison_markdown(comparison), markdown_path)
    if interrupted:
        raise typer.Exit(INTERRUPTED)
    failed = [r for r in results if r.error is not None]
    if results and len(failed) == len(results):
        raise fail(f"every strategy failed: {failed[0].error}")
    if warn_invalid([(r.strategy.settings.max_new_tokens, s.reason)
                     for r in results for s in r.samples]):
        raise typer.Exit(1)  # as generate: an output is not valid under its grammar


def warn_invalid(finishes: list[tuple[int, str]]) -> bool:
    """`render.warn_incomplete` over (max_new_tokens, finish reason) pairs, one warning
    per budget; whether any output is not valid under its grammar."""
    from cli import render

    by_budget: dict[int, list[str]] = {}
    for budget, reason in finishes:
        by_budget.setdefault(budget, []).append(reason)
    return any([render.warn_incomplete(reasons, budget)
                for budget, reasons in by_budget.items()])
