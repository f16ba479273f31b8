"""`genlab speculate`: speculative decoding with a draft model or prompt lookup, streamed
with accepted draft tokens and target tokens in different colours, then the acceptance
and timing report (and, by default, the same prompt decoded plainly for the speed-up)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import options as opt
from cli import render_tokens
from cli.context import (
    chat_messages,
    encode_prompt,
    keep_last_tokens,
    load,
    prepare_grammar,
    read_prompt,
    settings_for,
)
from cli.errors import exit_code, fail, user_errors
from cli.output import Sink, opened, sink

if TYPE_CHECKING:
    from genlib.decoding.speculative import Drafting, Summary
    from genlib.events import Event, Finish, Token
    from genlib.models.loading import LoadedModel
    from genlib.settings.config import GenerationSettings

SPEC_PANEL = "Speculation"
BAR_WIDTH = 20


def pick_draft(target_ref: str, draft_model: str | None, prompt_lookup: int | None
               ) -> str | None:
    """The draft model to load (None for prompt lookup alone). Without either flag, the
    built-in draft pairs with the built-in target; any other target needs a flag."""
    from genlib.models.loading import (
        DEFAULT_DRAFT,
        DEFAULT_DRAFT_NAME,
        DEFAULT_MODEL_NAME,
        display_name,
    )

    if draft_model is not None or prompt_lookup is not None:
        return draft_model
    if display_name(target_ref) == DEFAULT_MODEL_NAME and DEFAULT_DRAFT.is_dir():
        return DEFAULT_DRAFT_NAME
    raise fail(f"no drafter for {target_ref}: pass --draft-model PATH|ID (a small model with "
               f"the same tokenizer) or --prompt-lookup N (drafts from the context, no model)")


def drafter_name(draft: LoadedModel | None, prompt_lookup: int | None) -> str:
    """Who drafts, as the report and the JSON's `drafter` name it."""
    lookup = f"prompt-lookup (n={prompt_lookup})" if prompt_lookup is not None else None
    if draft is None:
        assert lookup is not None
        return lookup
    return draft.ref if lookup is None else f"{lookup}, then {draft.ref}"


def stream_speculation(target: LoadedModel, ids: list[int], settings: GenerationSettings,
                       drafting: Drafting, live: bool, logprobs: int = 0,
                       backend: str = "auto") -> tuple[list[Event], bool, float]:
    """Run speculation on the user's `backend`, streaming its text when `live`: (events,
    whether Ctrl-C cut it short, seconds spent printing), the last to keep printing out
    of its timing, as the baseline prints nothing."""
    from cli import render
    from genlib.decoding.detail import Detail
    from genlib.decoding.step import collect
    from genlib.events import Finish, Token
    from genlib.generate import stream

    printing = 0.0

    def handle(event: Any) -> None:
        nonlocal printing
        if not live:
            return
        if isinstance(event, Token):  # within the run's clock, which Finish stops
            start = time.perf_counter()
            render.stream_text(event.text, render.DRAFT_STYLE if event.draft
                               else render.TARGET_STYLE)
            printing += time.perf_counter() - start
        elif isinstance(event, Finish):
            render.stream_text(event.tail)
            render.end_line()

    detail = Detail(logprobs=logprobs) if logprobs else None
    events = stream(target, [ids], settings, drafter=drafting, detail=detail, backend=backend)
    seen, interrupted = collect(events, handle)
    return seen, interrupted, printing


def without_printing(summary: Summary, printing: float) -> Summary:
    """The run's summary with the seconds spent printing its stream taken out of its
    decode time, so that it is timed as the baseline is (which prints nothing)."""
    import dataclasses

    return dataclasses.replace(summary, decode_seconds=max(summary.decode_seconds - printing,
                                                           0.0))


def run_baseline(target: LoadedModel, ids: list[int], settings: GenerationSettings,
                 backend: str = "auto") -> tuple[Finish, float]:
    """Plain decoding of the same prompt and settings: (finish, decode tokens/s)."""
    from genlib.events import Finish, Prefill
    from genlib.generate import stream

    events = list(stream(target, [ids], settings, backend=backend))
    prefill = next(e for e in events if isinstance(e, Prefill))
    finish = next(e for e in events if isinstance(e, Finish))
    seconds = finish.end - prefill.time
    return finish, (finish.new_tokens / seconds if seconds > 0 else 0.0)


def summary_json(s: Summary) -> dict[str, Any]:
    return {
        "acceptance_rate": round(s.acceptance_rate, 4),
        "alpha": round(s.alpha, 4),
        "proposed": s.proposed,
        "accepted": s.accepted,
        "target_forwards": s.steps,
        "tokens_per_forward": round(s.tokens_per_forward, 4),
        "mean_accepted_per_forward": round(s.mean_accepted, 4),
        "mean_num_draft_tokens": round(s.mean_gamma, 3),
        "by_position": [{"position": i + 1, "proposed": p, "accepted": a,
                         "rate": round(a / p, 4) if p else 0.0}
                        for i, (p, a) in enumerate(s.by_position)],
        "draft_seconds": round(s.draft_seconds, 6),
        "target_seconds": round(s.target_seconds, 6),
        "draft_forwards": s.draft_forwards,
        "cost_ratio": round(s.cost_ratio, 4),
        "prefill_s": round(s.prefill_seconds, 6),
        "tokens_per_s": round(s.tokens_per_second, 3),
    }


# Finish reasons of a run that --max-time ended, wherever its clock ran out
# (grammar_incomplete also ends a run at the token budget, where both runs stop alike).
TIMED_OUT = ("time", "grammar_incomplete")


def identical_to_plain(ran: Finish, plain: Finish) -> bool:
    """Whether the speculative output is plain decoding's, token for token: on the
    tokens both runs produced where --max-time ended either, since each stopped at its
    own moment."""
    if ran.reason in TIMED_OUT or plain.reason in TIMED_OUT:
        both = min(len(ran.token_ids), len(plain.token_ids))
        return ran.token_ids[:both] == plain.token_ids[:both]
    return ran.token_ids == plain.token_ids


def identical_line(ran: Finish, plain: Finish) -> str:
    """The report's verdict on greedy identity (`identical_to_plain`), saying how many
    tokens it covers when the runs' lengths differ (--max-time ended one)."""
    if not identical_to_plain(ran, plain):
        return "[red]NO[/]"
    both = min(len(ran.token_ids), len(plain.token_ids))
    if len(ran.token_ids) == len(plain.token_ids):
        return "[green]yes[/]"
    return f"[green]yes[/] (up to token {both}, where --max-time stopped the shorter run)"


def render_report(s: Summary, drafter: str, baseline_tps: float | None,
                  identical: str | None, do_sample: bool) -> None:
    """The acceptance/timing report on stderr: a label column and a value column whose
    values wrap at words within the terminal's width."""
    from rich.table import Table

    from cli import render

    err = render.err
    err.print(f"[bold]speculation[/] · drafter {drafter} · [green]draft[/] / "
              f"[bold]target[/] tokens", soft_wrap=False)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, min_width=18)
    grid.add_column(overflow="fold")
    for label, value in report_rows(s, baseline_tps):
        grid.add_row(f"  {label}", value)
    err.print(grid, soft_wrap=False)
    if identical is not None and not do_sample:
        err.print(f"  greedy output identical to plain decoding: {identical}", soft_wrap=False)


def report_rows(s: Summary, baseline_tps: float | None) -> list[tuple[str, str]]:
    """The report's (label, value) rows, values in Rich markup."""
    rows = [("acceptance", f"{s.acceptance_rate:6.1%}  ({s.accepted}/{s.proposed} draft "
                           f"tokens; alpha {s.alpha:.2f})"),
            ("per target fwd", f"{s.tokens_per_forward:6.2f} tokens  ({s.mean_accepted:.2f} "
                               f"accepted drafts, mean gamma {s.mean_gamma:.1f}, "
                               f"{s.steps} forwards)")]
    for i, (proposed, accepted) in enumerate(s.by_position):
        rate = accepted / proposed if proposed else 0.0
        bar = "█" * round(rate * BAR_WIDTH)
        rows.append((f"position {i + 1}", f"[green]{bar:<{BAR_WIDTH}}[/] {rate:6.1%} "
                                          f"({accepted}/{proposed})"))
    rows.append(("time", f"draft {s.draft_seconds:.3f} s ({s.draft_forwards} fwd) · target "
                         f"{s.target_seconds:.3f} s ({s.steps} fwd) · cost ratio c "
                         f"{s.cost_ratio:.3f}"))
    speed = f"{s.tokens_per_second:.1f} tok/s"
    if baseline_tps:
        speed += (f" vs plain {baseline_tps:.1f} tok/s → [bold]"
                  f"{s.tokens_per_second / baseline_tps:.2f}x[/] (formula predicts "
                  f"{s.predicted_speedup():.2f}x)")
    rows.append(("speed", speed))
    if baseline_tps and s.steps:
        cost = s.verify_cost(baseline_tps)
        rows.append(("verify cost", f"a target forward over gamma+1 tokens took {cost:.2f}x "
                                    f"a plain decoding step (the formula assumes 1x; with "
                                    f"it: {s.predicted_speedup(cost):.2f}x)"))
    return rows


def result_json(target: LoadedModel, drafter: str, prompt: str, prompt_tokens: int,
                finish: Finish, s: Summary, baseline: tuple[Finish, float] | None,
                settings: GenerationSettings, num_draft_tokens: int, adaptive: bool,
                backend: dict[str, str], draft_weights: str | None,
                tokens: Sequence[Token] = ()) -> dict[str, Any]:
    """The run as JSON; with --logprobs, its output carries each token's in the
    OpenAI/vLLM shape (as generate's outputs do). `draft_weights`: how the draft model's
    matrices were stored (None: no draft model, or no prefill)."""
    from cli import output

    extra: dict[str, Any] = {}
    if tokens and tokens[0].detail is not None:
        from genlib.lab.explain import logprobs_content

        extra["logprobs"] = logprobs_content(target, tokens)
    base_json = None
    speedup = None
    if baseline is not None:
        base_finish, base_tps = baseline
        base_json = output.finish_output(
            base_finish, 1, tokens_per_s=round(base_tps, 3),
            identical=identical_to_plain(finish, base_finish),
            verify_cost=round(s.verify_cost(base_tps), 4),
            predicted_speedup_with_verify_cost=round(
                s.predicted_speedup(s.verify_cost(base_tps)), 4))
        speedup = round(s.tokens_per_second / base_tps, 4) if base_tps else None
    out = output.output(1, finish.text, finish.token_ids, finish.reason, output.timings(
        total_s=finish.end - finish.start, prefill_s=s.prefill_seconds, ttft_s=finish.ttft,
        tokens_per_s=s.tokens_per_second), **extra)
    return output.run_document(
        "speculate", target.ref, settings, prompt, prompt_tokens, [out], drafter=drafter,
        draft_weights=draft_weights, num_draft_tokens=num_draft_tokens, adaptive=adaptive,
        speculation=summary_json(s), baseline=base_json, speedup=speedup,
        predicted_speedup=round(s.predicted_speedup(), 4), backend=backend)


@user_errors
@opt.options(
    ("as_json", opt.without(opt.DECODING, "num_return_sequences") + opt.SAMPLERS
     + opt.CONSTRAINTS + opt.PROMPT_OPTIONS), ("", opt.MODEL_OPTIONS),
    helps={"strategy": "Greedy or sample (speculative decoding has no beam search)."})
def speculate(
    prompt: opt.Prompt = None,
    model: opt.Model = None,
    draft_model: Annotated[str | None, typer.Option(
        "--draft-model", "-d", rich_help_panel=SPEC_PANEL,
        help="Draft model (hub id, folder or builtin:NAME) sharing the target's tokenizer. "
             "Default with builtin:code-small: builtin:code-tiny.")] = None,
    prompt_lookup: Annotated[int | None, typer.Option(
        "--prompt-lookup", rich_help_panel=SPEC_PANEL,
        help="Draft with no model: continue the latest earlier match of the last N-gram "
             "(N down to 1) in the context. With --draft-model: lookup first, the draft "
             "model where the context has no match.")] = None,
    num_draft_tokens: Annotated[int | None, typer.Option(
        "--num-draft-tokens", "-g", rich_help_panel=SPEC_PANEL,
        help="Tokens drafted per step, gamma (default 5; 10 with --prompt-lookup alone).")
    ] = None,
    adaptive: Annotated[bool | None, typer.Option(
        "--adaptive/--fixed", rich_help_panel=SPEC_PANEL, show_default=False,
        help="Adapt gamma: +2 after a fully accepted block, -1 after a rejection. "
             "Default: adaptive with a draft model, fixed with --prompt-lookup alone.")
    ] = None,
    draft_weights: Annotated[str, typer.Option(
        "--draft-weights", rich_help_panel=SPEC_PANEL,
        help="auto, float32 or bfloat16: how the native backend stores the draft model's "
             "matrices (auto: bfloat16 where the draft runs on it, half the reads; the "
             "arithmetic stays float32; greedy tokens are the same either way, and "
             "sampling keeps the target's law).")
    ] = "auto",
    baseline: Annotated[bool, typer.Option(
        "--baseline/--no-baseline", rich_help_panel=SPEC_PANEL,
        help="Also decode without speculation and report the measured speed-up.")] = True,
    preset: opt.Preset = None,
    as_json: opt.Json = False,
    logprobs: opt.Logprobs = None,
    as_jsonl: opt.Jsonl = False,
    output: opt.OutputFile = None,
    **given: Any,
) -> None:
    """Speculative decoding: a draft proposes, the target verifies; acceptance shown.

    The output is the target's own: token-identical when greedy, the same law when sampling.

    Accepted draft tokens print green, the target's own bold.

    Examples:\n
      genlab speculate "def parse(line):" -m TARGET -d DRAFT\n
      genlab speculate "Once upon a time" -m ../shared/models/stories260K --prompt-lookup 3\n
      genlab speculate "def parse(line):" -m TARGET -d DRAFT --prompt-lookup 3\n
      genlab speculate "import os" -t 0.8 --seed 1 --fixed -g 3 --json
    """
    from genlib.backends.choose import check_draft_weights
    from genlib.backends.kernel import WEIGHTS
    from genlib.decoding.speculative import Drafting, check_request, draft_length
    from genlib.models.loading import resolve_model_ref

    flags = opt.given_settings(given, prompt)
    target_sink = sink(as_json, as_jsonl, output)
    settings, loaded_preset = settings_for(preset, flags)
    if settings.strategy == "beam":
        raise fail("speculative decoding does greedy or sampling, not beam search")
    target_ref = resolve_model_ref(model, loaded_preset.model if loaded_preset else None)
    draft_ref = pick_draft(target_ref, draft_model, prompt_lookup)
    check_draft_weights(draft_weights, draft_ref is not None)  # before the models load
    text = read_prompt(prompt)
    model_flags = opt.model_flags(given, target_ref)
    target = load(model_flags)
    # the kernels the draft may run (auto: choose.draft_request picks), built announced
    kernels = tuple(WEIGHTS) if draft_weights == "auto" else (draft_weights,)
    draft = load(opt.model_flags(given, draft_ref),
                 weights=kernels) if draft_ref is not None else None
    ids = encode_prompt(target, text, opt.prompt_flags(given), settings.max_new_tokens)
    target_sink.messages = chat_messages(text, opt.prompt_flags(given))
    prepare_grammar(target, settings)
    if given["truncate_prompt"] and draft is not None and draft.max_positions is not None:
        # the draft reads the prompt too: cut it to fit the shorter context of the two
        ids = keep_last_tokens(target, ids, draft.max_positions - settings.max_new_tokens)
    # before the rehearsal, which feeds both models the prompt
    check_request(target, ids, settings, draft, draft_length(num_draft_tokens, draft is not None))
    drafting = Drafting(draft_lm=draft, prompt_lookup=prompt_lookup,
                        num_draft_tokens=num_draft_tokens, adaptive=adaptive,
                        draft_weights=draft_weights)
    with opened(target_sink) as out:
        code = report(target, drafting, ids, text, settings, baseline, out, logprobs or 0,
                      given["backend"])
    if code:
        raise typer.Exit(code)


REHEARSAL_TOKENS = 8


def rehearse(target: LoadedModel, ids: list[int], settings: GenerationSettings,
             drafting: Drafting, baseline: bool, backend: str = "auto") -> None:
    """An untimed short run of each side the report compares (speculation, and plain
    decoding where it runs), so that first-call costs (a backend's allocations and lazy
    set-up, the draft kernel's first call, code the speculative path imports on first
    use) fall on neither timed run."""
    from genlib.generate import stream

    tokens = min(REHEARSAL_TOKENS, settings.max_new_tokens)
    short = settings.replace(max_new_tokens=tokens,
                             min_new_tokens=min(settings.min_new_tokens, tokens))
    for _ in stream(target, [ids], short, drafter=drafting, backend=backend):
        pass
    if baseline:
        for _ in stream(target, [ids], short, backend=backend):
            pass


def report(target: LoadedModel, drafting: Drafting, ids: list[int], text: str,
           settings: GenerationSettings, baseline: bool, sink: Sink, logprobs: int = 0,
           backend: str = "auto") -> int:
    """Stream the speculative run, then the baseline and the report, on the user's
    `backend`; the exit code."""
    from cli import output
    from genlib.backends.choose import architecture
    from genlib.decoding.speculative import adapts, draft_length, summarize
    from genlib.events import Finish, Token

    draft = drafting.draft_lm
    rehearse(target, ids, settings, drafting, baseline, backend)
    drafter = drafter_name(draft, drafting.prompt_lookup)
    events, interrupted, printing = stream_speculation(
        target, ids, settings, drafting, live=not sink.machine, logprobs=logprobs,
        backend=backend)
    finish = next(e for e in events if isinstance(e, Finish))
    interrupted = interrupted or finish.reason == "interrupted"
    summary = without_printing(summarize(events), printing)
    plain = run_baseline(target, ids, settings, backend) if baseline and not interrupted \
        else None
    if plain is not None and plain[0].reason == "interrupted":
        plain, interrupted = None, True  # a cut-off baseline would give a false comparison
    tokens = [e for e in events if isinstance(e, Token)]
    prefill = next((e for e in events if type(e).__name__ == "Prefill"), None)
    backend = {"name": prefill.backend, "reason": prefill.backend_reason,
               "architecture": architecture(target)} if prefill else {}
    weights = prefill.draft_weights if prefill else None  # as the drafter that ran has them
    gamma = draft_length(drafting.num_draft_tokens, draft is not None)
    doc = result_json(target, drafter, text, len(ids), finish, summary, plain, settings,
                      gamma, adapts(drafting.adaptive, draft is not None), backend, weights,
                      tokens)
    sink.json_document(doc)
    sink.json_line(output.line(doc, doc["outputs"][0], speedup=doc["speedup"]))
    if not sink.machine:
        if logprobs:
            render_tokens.logprobs_table(target, tokens, settings)
        shown = drafter + (" (bfloat16 weights)" if weights == "bfloat16" else "")
        render_report(summary, shown, plain[1] if plain else None,
                      identical_line(finish, plain[0]) if plain else None,
                      settings.do_sample)
    return exit_code([finish.reason], settings.max_new_tokens, interrupted)
