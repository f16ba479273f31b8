"""`genlab explain`: step through one generation and show what every stage of the
processor chain did at each step; `--branch STEP:TOKEN` adds a counterfactual."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import context, output
from cli import options as opt
from cli.errors import fail, user_errors

if TYPE_CHECKING:
    from genlib.models.loading import LoadedModel
    from genlib.settings.config import GenerationSettings

# explain's own defaults: a layer between genlab's defaults and the preset, so a
# preset's max_new_tokens (and a flag, above both) overrides them.
EXPLAIN_DEFAULTS = {"max_new_tokens": 20}


def parse_steps(text: str | None) -> tuple[int, int | None]:
    """`--steps A:B` -> (A, B) (B exclusive, None = to the end); `A` alone is one step."""
    if not text:
        return 0, None
    try:
        if ":" not in text:
            return int(text), int(text) + 1
        a, b = text.split(":", 1)
        first, last = (int(a) if a else 0), (int(b) if b else None)
    except ValueError:
        raise fail(f"--steps {text!r}: give A:B with step numbers (0-based), e.g. 0:10") from None
    if first < 0 or (last is not None and last <= first):
        raise fail(f"--steps {text!r}: need 0 <= A < B")
    return first, last


def warn_if_no_step(steps: str, first: int, runs: list[dict[str, Any]]) -> None:
    """A warning when `--steps A:B` selects none of the steps the view would show."""
    from cli.render import warn

    count = max(len(run["steps"]) for run in runs)
    if first >= count:
        which = "the run has" if len(runs) == 1 else "the longer run has"
        have = "no steps" if count == 0 else f"{count} steps (0-{count - 1})"
        warn(f"--steps {steps} selects no step: {which} {have}")


def parse_branch(lm: LoadedModel, text: str, max_new_tokens: int) -> tuple[int, int]:
    """`--branch STEP:TOKEN` -> (step, token id)."""
    from cli.context import text_of
    from genlib.lab.explain import parse_branch as branch_point

    step, _, token = text_of(text, "--branch").partition(":")
    return branch_point(lm, step, token, max_new_tokens, name="--branch",
                        limit="--max-new-tokens",
                        usage=f"--branch {text!r}: give STEP:TOKEN, e.g. 3:#421 (a token id) "
                              f"or \"3: the\" (a text that is one token of the model)")


def explain_record(lm: LoadedModel, ids: list[int], prompt: str,
                   settings: GenerationSettings, top: int,
                   branch: tuple[int, int] | None, backend: str = "auto") -> dict[str, Any]:
    """The whole `--json` document (docs/output.md): the original run and, with a
    branch, the branch and where the two diverge; on the user's `backend`."""
    from genlib.lab.explain import divergence, explain, model_logprobs, run_dict

    original = explain(lm, ids, settings, top=top, backend=backend)
    record = output.document(
        "explain", lm.ref, prompt=prompt, prompt_tokens=len(ids),
        settings=settings.to_dict(),
        sampler="inverse_cdf" if settings.do_sample else "greedy",
        original=run_dict(lm, original,
                          model_logprobs(lm, settings, ids, original, backend)))
    if branch is not None:
        forked = explain(lm, ids, settings, top=top, force={branch[0]: branch[1]},
                         backend=backend)
        record["branch"] = {"step": branch[0], "token_id": branch[1], **run_dict(
            lm, forked, model_logprobs(lm, settings, ids, forked, backend))}
        record["branch"]["diverges_at"] = divergence(original.ids, forked.ids)
    return record


def step_lines(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The --jsonl lines: each run's steps in order (the original's, then a branch's),
    each the --json document's step with `run` and the run's facts beside it."""
    shared = {key: record[key] for key in ("schema_version", "genlab_version", "command",
                                           "model", "prompt", "prompt_tokens", "settings",
                                           "sampler")}
    return [shared | {"run": run} | step
            for run in ("original", "branch") if run in record
            for step in record[run]["steps"]]


@user_errors
@opt.options(
    ("ensemble", opt.without(opt.DECODING, "num_return_sequences", "max_time")
     + opt.SAMPLERS + opt.CONSTRAINTS),
    ("amateur", ("ensemble_mode",)),
    ("steps", ("cd_beta", "cd_alpha") + opt.PROMPT_OPTIONS), ("", opt.MODEL_OPTIONS),
    helps={"max_new_tokens": "Tokens to generate at most (default: the preset's, else 20)."})
def explain(
    prompt: opt.Prompt = None,
    model: opt.Model = None,
    preset: opt.Preset = None,
    ensemble: opt.Ensemble = None,
    amateur: opt.Amateur = None,
    steps: Annotated[str | None, typer.Option(
        "--steps", rich_help_panel=opt.OUTPUT_PANEL,
        help="Steps to show, A:B (0-based, B excluded; default all), in the terminal "
        "view or the --html page.")] = None,
    top: Annotated[int, typer.Option(
        "--top", min=1, max=20, rich_help_panel=opt.OUTPUT_PANEL,
        help="Candidates shown per step (the raw model's most probable).")] = 5,
    branch: Annotated[str | None, typer.Option(
        "--branch", help="STEP:TOKEN: force TOKEN (a text that is one token, or #id) at "
        "STEP and continue with the same random draws; shows both runs and where they "
        "diverge.")] = None,
    as_json: opt.Json = False,
    as_jsonl: Annotated[bool, typer.Option(
        "--jsonl", rich_help_panel=opt.OUTPUT_PANEL,
        help="Print one JSON object per step (the --json document's steps, with the run "
             "and its facts beside each), for pipes.")] = False,
    output_file: opt.OutputFile = None,
    html_file: Annotated[Path | None, typer.Option(
        "--html", rich_help_panel=opt.OUTPUT_PANEL,
        help="Write one self-contained page: tokens coloured by probability, click one "
        "for its step (with --branch, both runs).")] = None,
    **given: Any,
) -> None:
    """Step through a generation and see why each token was chosen.

    Each step shows its top candidates and their probability after each sampler stage.

    It also shows the mass each stage removed, the entropy, the chosen token and the draw.

    Examples:\n
      genlab explain "Once upon a time" -t 0.8 --top-k 20 --seed 1 -n 10\n
      genlab explain "def add(a, b):" --seed 1 -t 0.8 --branch 1:pass\n
      genlab explain "def add(a, b):" --html explain.html
    """
    from cli import render, render_explain
    from genlib.lab.explain import runs_of

    flags = opt.given_settings(given, prompt)
    target = output.sink(as_json, as_jsonl, output_file)
    if steps and target.machine and html_file is None:
        raise fail(f"--steps selects the steps of the terminal view or the --html page; "
                   f"--{target.mode} writes every step (drop --steps, or add --html FILE)")
    if html_file is not None:
        from cli.paths import check_output_path

        check_output_path(html_file, "--html")
    first, last = parse_steps(steps)
    model_flags = opt.model_flags(given, model, ensemble, amateur)
    settings, loaded_preset = context.settings_for(
        preset, flags, EXPLAIN_DEFAULTS | context.combination_defaults(model_flags, flags))
    if settings.strategy == "beam":
        raise fail("explain steps through greedy or sampled decoding, not beam search "
                   "(see `genlab beam --tree`)")
    text = context.read_prompt(prompt)
    lm = context.load(model_flags, loaded_preset)
    ids = context.encode_prompt(lm, text, opt.prompt_flags(given), settings.max_new_tokens)
    target.messages = context.chat_messages(text, opt.prompt_flags(given))
    context.prepare_grammar(lm, settings)
    forced = parse_branch(lm, branch, settings.max_new_tokens) if branch else None
    record = explain_record(lm, ids, text, settings, top, forced, model_flags.backend)
    runs = runs_of(record)
    invalid = render.warn_incomplete([run["finish_reason"] for run in runs.values()],
                                     settings.max_new_tokens)
    if steps:  # the page shows both runs' steps, the terminal view the original's
        shown = list(runs.values()) if html_file else [record["original"]]
        warn_if_no_step(steps, first, shown)
    if html_file is not None:
        from cli.explain_html import page

        html_file.write_text(page(record, first, last), encoding="utf-8")
        render.info(f"wrote {html_file}")
    with output.opened(target):
        if target.machine:
            target.json_document(record)
            for line in step_lines(record):
                target.json_line(line)
        elif html_file is None:
            render_explain.show_steps(record["original"]["steps"], first, last)
            if "branch" in record:
                render_explain.show_branch(record["original"], record["branch"])
    if invalid:  # as generate: the output is not valid under its grammar
        raise typer.Exit(1)
