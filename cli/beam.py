"""`genlab beam`: beam search (plain, sampled, diverse, constrained), its n-best beside
the greedy output, and optionally the search tree."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import options as opt
from cli.context import (
    chat_messages,
    combination_defaults,
    encode_prompt,
    load,
    prepare_grammar,
    read_prompt,
    settings_for,
)
from cli.errors import INTERRUPTED, exit_code, fail, user_errors
from cli.output import Sink, opened, sink
from genlib.settings.config import resolve_settings

if TYPE_CHECKING:
    from collections.abc import Generator

    from genlib.decoding.beam import BeamResult, Hypothesis
    from genlib.events import Finish
    from genlib.models.loading import LoadedModel
    from genlib.settings.config import GenerationSettings


def greedy_settings(settings: GenerationSettings) -> GenerationSettings:
    """The same settings with greedy decoding, for the contrast row."""
    data = settings.to_dict() | {
        "strategy": "greedy", "do_sample": False, "num_beams": 1, "num_return_sequences": 1,
        "num_beam_groups": 1, "diversity_penalty": 0.0, "force_words": [], "force_any": []}
    return resolve_settings({}, data)


def hypothesis_output(rank: int, hyp: Hypothesis, seconds: float) -> dict[str, Any]:
    """A hypothesis as an output of the JSON contract: `index` is its rank, from 1 as in
    the table; its timings are the whole search's (the beams are found together)."""
    from cli import output

    return output.output(rank, hyp.text, hyp.token_ids, hyp.finish_reason,
                         output.timings(total_s=seconds), score=hyp.score,
                         sum_logprob=hyp.sum_logprob, token_logprobs=list(hyp.logprobs),
                         constraints_satisfied=hyp.constraints_satisfied)


def result_json(lm: LoadedModel, prompt: str, prompt_tokens: int, result: BeamResult,
                greedy: Finish | None, settings: GenerationSettings, seconds: float,
                tree: bool, backend: dict[str, str]) -> dict[str, Any]:
    from cli import output
    from cli.render_beam import tree_json

    outputs = [hypothesis_output(r, h, seconds) for r, h in enumerate(result.hypotheses, 1)]
    greedy_out = None if greedy is None else output.finish_output(
        greedy, 1, sum_logprob=sum(greedy.logprobs))
    extra: dict[str, Any] = {"tree": tree_json(result)} if tree else {}
    return output.run_document("beam", lm.ref, settings, prompt, prompt_tokens, outputs,
                               steps=result.steps, greedy=greedy_out, backend=backend,
                               **extra)


def run_beam(lm: LoadedModel, ids: list[int], prompt: str, settings: GenerationSettings,
             *, sink: Sink, tree: bool, tree_steps: int, tree_width: int,
             with_greedy: bool, backend: str = "auto") -> int:
    """Search, run the greedy contrast, show both; the exit code: INTERRUPTED when Ctrl-C
    cut the search short (its best beams so far are shown, marked "interrupted", and
    greedy is skipped), 1 when an output is not valid under its grammar, else 0."""
    import time

    from cli import output, render
    from genlib.backends.choose import architecture
    from genlib.backends.combined import for_generation
    from genlib.decoding.beam import backend_request, search
    from genlib.generate import generate

    searcher = for_generation(lm, [ids], settings, backend_request([ids], settings, backend))
    start = time.perf_counter()
    run = search(lm, [ids], settings, record_tree=tree, backend=searcher)
    live = tree and not sink.machine and render.out.is_terminal
    result = (draw_live(run, prompt, tree_steps, tree_width) if live else finish(run))[0]
    seconds = time.perf_counter() - start
    greedy = generate(lm, [ids], greedy_settings(settings), backend=backend)[0] \
        if with_greedy and not result.interrupted else None
    # The greedy run's loop keeps a Ctrl-C too: its row ends "interrupted".
    interrupted = result.interrupted or (greedy is not None and greedy.reason == "interrupted")
    doc = result_json(lm, prompt, len(ids), result, greedy, settings, seconds, tree,
                      {"name": searcher.name, "reason": searcher.reason,
                       "architecture": architecture(lm)})
    for out in doc["outputs"]:
        sink.json_line(output.line(doc, out, role="beam"))
    if doc["greedy"] is not None:
        sink.json_line(output.line(doc, doc["greedy"], role="greedy"))
    sink.json_document(doc)
    if not sink.machine:
        show_results(result, greedy, prompt, settings, interrupted,
                     tree=tree, live=live, tree_steps=tree_steps, tree_width=tree_width)
        render.info(f"{result.steps} steps · {settings.num_beams} beams · {seconds:.2f} s · "
                    f"backend {searcher.name}")
    return exit_code([h.finish_reason for h in result.hypotheses], settings.max_new_tokens,
                     interrupted)


def show_results(result: BeamResult, greedy: Finish | None, prompt: str,
                 settings: GenerationSettings, interrupted: bool, *, tree: bool, live: bool,
                 tree_steps: int, tree_width: int) -> None:
    """The terminal view: the tree (unless drawn live), the n-best table, and a warning
    for forced phrases the search could not place."""
    from cli import render, render_beam

    if tree and live:
        render_beam.tree_notes(result.tree or [], tree_steps, tree_width)
    elif tree:
        render_beam.search_tree(result, prompt, tree_steps, tree_width)
    render_beam.nbest_table(prompt, result.hypotheses, greedy, settings.length_penalty)
    if not interrupted and any(h.constraints_satisfied is False for h in result.hypotheses):
        ngram = settings.no_repeat_ngram_size
        render.warn(f"some outputs do not contain every forced phrase (marked NOT met): the "
                    f"search could not place them within max_new_tokens"
                    f"{' under --no-repeat-ngram-size' if ngram else ''}; raise "
                    f"--max-new-tokens or --num-beams"
                    f"{', or lower --no-repeat-ngram-size' if ngram else ''}")


def finish(run: Generator[Any, None, list[BeamResult]]) -> list[BeamResult]:
    """Run a search to its end; its results (a Ctrl-C ends it with the best so far)."""
    return draw_live(run, None, 0, 0)


def draw_live(run: Generator[Any, None, list[BeamResult]], prompt: str | None,
              tree_steps: int, tree_width: int) -> list[BeamResult]:
    """Run a search to its end, drawing its tree as each step comes when `prompt` is
    given (on stdout, a terminal); a Ctrl-C ends the search with its best beams so far."""
    from rich.live import Live

    from cli import render, render_beam
    from genlib.decoding.beam import TreeStep
    from genlib.events import BeamStep

    steps: list[TreeStep] = []
    view = Live(console=render.out, auto_refresh=False) if prompt is not None else None
    try:
        if view is not None:
            view.start()
        while True:
            try:
                event = run.send(None)
            except KeyboardInterrupt:
                event = run.throw(KeyboardInterrupt())
            if view is not None and isinstance(event, BeamStep) and event.candidates \
                    and event.step < tree_steps:
                steps.append(TreeStep(event.step, event.candidates))
                view.update(render_beam.tree_view(steps, prompt or "", tree_steps,
                                                  tree_width), refresh=True)
    except StopIteration as stop:
        return stop.value
    finally:
        if view is not None:
            view.stop()


@user_errors
@opt.options(
    ("ensemble", opt.BEAM + opt.without(opt.DECODING, "strategy", "num_return_sequences")
     + opt.SAMPLERS + opt.CONSTRAINTS),
    ("amateur", ("ensemble_mode",)), ("tree", ("cd_beta", "cd_alpha")),
    ("as_json", opt.PROMPT_OPTIONS), ("", opt.MODEL_OPTIONS),
    helps={"temperature": "Sampling temperature (> 0) for beam sampling (--sample)."})
def beam(
    prompt: opt.Prompt = None,
    model: opt.Model = None,
    preset: opt.Preset = None,
    ensemble: opt.Ensemble = None,
    amateur: opt.Amateur = None,
    tree: Annotated[bool, typer.Option(
        "--tree", rich_help_panel=opt.OUTPUT_PANEL,
        help="Draw the search tree: candidates kept, finished and pruned at each step.")
    ] = False,
    tree_steps: Annotated[int, typer.Option(
        "--tree-steps", rich_help_panel=opt.OUTPUT_PANEL, min=1,
        help="Steps drawn with --tree.")] = 5,
    tree_width: Annotated[int, typer.Option(
        "--tree-width", rich_help_panel=opt.OUTPUT_PANEL, min=1,
        help="Candidates drawn per beam with --tree.")] = 4,
    no_greedy: Annotated[bool, typer.Option(
        "--no-greedy", rich_help_panel=opt.OUTPUT_PANEL,
        help="Skip the greedy run shown for contrast.")] = False,
    as_json: opt.Json = False,
    as_jsonl: opt.Jsonl = False,
    output: opt.OutputFile = None,
    **given: Any,
) -> None:
    """Beam search: the n best continuations with their scores, beside the greedy one.

    Examples:\n
      genlab beam "Once upon a time" -m ../shared/models/stories260K -k 4 --tree\n
      genlab beam "Once upon a time" --force dog --force-any "cat|bird"\n
      genlab beam "Once upon a time" -k 6 --num-beam-groups 3 --diversity-penalty 1.0
    """
    flags = opt.given_settings(given, prompt) | {"strategy": "beam"}
    target = sink(as_json, as_jsonl, output)
    model_flags = opt.model_flags(given, model, ensemble, amateur)
    settings, loaded_preset = settings_for(preset, flags,
                                           combination_defaults(model_flags, flags))
    named = "num_return_sequences" in flags or (
        loaded_preset is not None and "num_return_sequences" in loaded_preset.settings)
    if not named:  # the whole n-best unless the flag or the preset asks for fewer
        settings = settings.replace(num_return_sequences=settings.num_beams)
    text = read_prompt(prompt)
    lm = load(model_flags, loaded_preset)
    ids = encode_prompt(lm, text, opt.prompt_flags(given), settings.max_new_tokens)
    target.messages = chat_messages(text, opt.prompt_flags(given))
    prepare_grammar(lm, settings)
    with opened(target) as target:
        code = run_beam(lm, ids, text, settings, sink=target, tree=tree,
                        tree_steps=tree_steps, tree_width=tree_width,
                        with_greedy=not no_greedy, backend=given["backend"])
    if code == INTERRUPTED:
        raise fail("interrupted: the results above are those so far", INTERRUPTED)
    if code:
        raise typer.Exit(code)
