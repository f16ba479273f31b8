"""`genlab beam`: beam search (plain, sampled, diverse, constrained), its n-best beside
the greedy output, and optionally the search tree."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import options as opt
from cli.context import ModelFlags, load, settings_for
from cli.errors import INTERRUPTED, fail, user_errors
from cli.generate import encode_prompt, read_prompt, with_seed
from cli.output import Sink, opened, sink
from genlib.config import parse_value, resolve_settings

if TYPE_CHECKING:
    from genlib.beam import BeamResult, Hypothesis
    from genlib.config import GenerationSettings
    from genlib.events import Finish
    from genlib.models import LoadedModel

BEAM_PANEL = "Beam search"

NumBeams = Annotated[int | None, typer.Option(
    "--num-beams", "-k", rich_help_panel=BEAM_PANEL, help="Beams kept per prompt (default 4).")]
LengthPenalty = Annotated[float | None, typer.Option(
    "--length-penalty", rich_help_panel=BEAM_PANEL,
    help="score = logprob / length**penalty; > 0 favours longer outputs.")]
EarlyStopping = Annotated[str | None, typer.Option(
    "--early-stopping", rich_help_panel=BEAM_PANEL,
    help="true: stop when num_beams outputs are done; false: when no running beam can "
         "still win (heuristic); never: the exact rule.")]
Sample = Annotated[bool | None, typer.Option(
    "--sample/--no-sample", rich_help_panel=BEAM_PANEL,
    help="Beam sampling: draw the continuations instead of taking the best.")]
Groups = Annotated[int | None, typer.Option(
    "--num-beam-groups", rich_help_panel=BEAM_PANEL,
    help="Diverse beam search: split the beams into this many groups.")]
Diversity = Annotated[float | None, typer.Option(
    "--diversity-penalty", rich_help_panel=BEAM_PANEL,
    help="Diverse beam search: penalty per earlier group that chose a token this step.")]
Force = Annotated[list[str] | None, typer.Option(
    "--force", rich_help_panel=BEAM_PANEL, help="Phrase that must appear (repeatable).")]
Temperature = Annotated[float | None, typer.Option(
    "--temperature", "-t", rich_help_panel=opt.DECODING_PANEL,
    help="Sampling temperature (> 0) for beam sampling (--sample).")]
ForceAny = Annotated[list[str] | None, typer.Option(
    "--force-any", rich_help_panel=BEAM_PANEL,
    help="'A|B|C': one of these phrases must appear (repeatable).")]


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
                         sum_logprob=hyp.sum_logprob, logprobs=list(hyp.logprobs),
                         constraints_satisfied=hyp.constraints_satisfied)


def result_json(lm: LoadedModel, prompt: str, prompt_tokens: int, result: BeamResult,
                greedy: Finish | None, settings: GenerationSettings, seconds: float,
                tree: bool) -> dict[str, Any]:
    from cli import output
    from cli.render_beam import tree_json

    outputs = [hypothesis_output(r, h, seconds) for r, h in enumerate(result.hypotheses, 1)]
    greedy_out = None if greedy is None else output.finish_output(
        greedy, 1, sum_logprob=sum(greedy.logprobs))
    extra: dict[str, Any] = {"tree": tree_json(result)} if tree else {}
    return output.run_document("beam", lm.ref, settings, prompt, prompt_tokens, outputs,
                               steps=result.steps, greedy=greedy_out, **extra)


def run_beam(lm: LoadedModel, ids: list[int], prompt: str, settings: GenerationSettings,
             *, sink: Sink, tree: bool, tree_steps: int, tree_width: int,
             with_greedy: bool) -> bool:
    """Search, run the greedy contrast, show both; True when Ctrl-C cut the search short
    (its best beams so far are shown, marked "interrupted", and greedy is skipped)."""
    import time

    from cli import output, render, render_beam
    from genlib.beam import beam_search
    from genlib.decode import generate

    start = time.perf_counter()
    result = beam_search(lm, [ids], settings, record_tree=tree)[0]
    seconds = time.perf_counter() - start
    greedy = generate(lm, [ids], greedy_settings(settings))[0] \
        if with_greedy and not result.interrupted else None
    # The greedy run's loop keeps a Ctrl-C too: its row ends "interrupted".
    interrupted = result.interrupted or (greedy is not None and greedy.reason == "interrupted")
    doc = result_json(lm, prompt, len(ids), result, greedy, settings, seconds, tree)
    for out in doc["outputs"]:
        sink.json_line(output.line(doc, out, role="beam"))
    if doc["greedy"] is not None:
        sink.json_line(output.line(doc, doc["greedy"], role="greedy"))
    sink.json_document(doc)
    sink.texts([h.text for h in result.hypotheses])
    if sink.machine:
        return interrupted
    if tree:
        render_beam.search_tree(result, prompt, tree_steps, tree_width)
    render_beam.nbest_table(prompt, result.hypotheses, greedy, settings.length_penalty)
    if not interrupted and any(h.constraints_satisfied is False for h in result.hypotheses):
        render.warn("some outputs do not contain every forced phrase (marked NOT met): the "
                    "model could not fit them in max_new_tokens; raise --max-new-tokens or "
                    "--num-beams")
    render.info(f"{result.steps} steps · {settings.num_beams} beams · {seconds:.2f} s")
    return interrupted


@user_errors
def beam(
    prompt: Annotated[str | None, typer.Argument(
        help="The prompt; `-` or omitted with piped input reads stdin.")] = None,
    model: opt.Model = None,
    preset: opt.Preset = None,
    num_beams: NumBeams = None,
    length_penalty: LengthPenalty = None,
    early_stopping: EarlyStopping = None,
    num_return_sequences: opt.NumReturn = None,
    sample: Sample = None,
    num_beam_groups: Groups = None,
    diversity_penalty: Diversity = None,
    force: Force = None,
    force_any: ForceAny = None,
    max_new_tokens: opt.MaxNewTokens = None,
    min_new_tokens: opt.MinNewTokens = None,
    temperature: Temperature = None,
    top_k: opt.TopK = None,
    top_p: opt.TopP = None,
    min_p: opt.MinP = None,
    typical_p: opt.TypicalP = None,
    repetition_penalty: opt.RepetitionPenalty = None,
    no_repeat_ngram_size: opt.NoRepeatNgram = None,
    stop: opt.Stop = None,
    seed: opt.Seed = None,
    max_time: opt.MaxTime = None,
    ignore_eos: opt.IgnoreEos = None,
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
    chat: opt.Chat = False,
    system: opt.System = None,
    truncate_prompt: opt.TruncatePrompt = False,
    as_json: opt.Json = False,
    as_jsonl: opt.Jsonl = False,
    output: opt.OutputFile = None,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    quantize: opt.Quantize = "none",
    trust_remote_code: opt.TrustRemoteCode = False,
) -> None:
    """Beam search: the n best continuations with their scores, beside the greedy one.

    Examples:\n
      genlab beam "Once upon a time" -m ../shared/models/stories260K -k 4 --tree\n
      genlab beam "Once upon a time" --force dog --force-any "cat|bird"\n
      genlab beam "Once upon a time" -k 6 --num-beam-groups 3 --diversity-penalty 1.0
    """
    flags = opt.decoding_flags(
        locals(), strategy="beam", num_beams=num_beams, length_penalty=length_penalty,
        early_stopping=None if early_stopping is None
        else parse_value("early_stopping", early_stopping),
        do_sample=sample, num_beam_groups=num_beam_groups,
        diversity_penalty=diversity_penalty, force_words=force or None,
        force_any=force_any or None)
    target = sink(as_json, as_jsonl, output)
    settings, loaded_preset = settings_for(preset, flags)
    settings = with_seed(settings)
    if settings.num_return_sequences == 1 and num_return_sequences is None:
        settings = settings.replace(num_return_sequences=settings.num_beams)
    text = read_prompt(prompt)
    lm = load(ModelFlags(model, device, dtype, quantize, trust_remote_code), loaded_preset)
    ids = encode_prompt(lm, text, chat, system, truncate_prompt, settings.max_new_tokens)
    with opened(target) as target:
        interrupted = run_beam(lm, ids, text, settings, sink=target, tree=tree,
                               tree_steps=tree_steps, tree_width=tree_width,
                               with_greedy=not no_greedy)
    if interrupted:
        raise fail("interrupted: the results above are those so far", INTERRUPTED)
