"""`genlab generate`: stream a completion for a prompt given as an argument or on stdin."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import options as opt
from cli import render_tokens
from cli.context import (
    chat_messages,
    combination_defaults,
    encode_prompt,
    load,
    load_scorer,
    prepare_grammar,
    read_prompt,
    settings_for,
)
from cli.errors import exit_code, user_errors
from cli.output import Json, Jsonl, Sink, opened, sink
from cli.settings_view import show_settings_table

if TYPE_CHECKING:
    from genlib.decoding.detail import Detail
    from genlib.events import Finish, Prefill, Rerank, Token
    from genlib.models.loading import LoadedModel
    from genlib.settings.config import GenerationSettings


def run_document(lm: LoadedModel, prompt: str, ids: list[int],
                 settings: GenerationSettings, prefill: Prefill | None) -> dict[str, Any]:
    """The run's JSON document (docs/output.md), its outputs to be filled in: with the
    backend that ran and why (the Prefill event's; none when the run stopped before)."""
    from cli import output
    from genlib.backends.choose import architecture

    ran = {"backend": {"name": prefill.backend, "reason": prefill.backend_reason,
                       "architecture": architecture(lm)}} if prefill else {}
    if lm.storage is not None or lm.disk_bytes is not None:
        ran["model_files"] = {"weights": lm.storage, "bytes": lm.disk_bytes}
    return output.run_document("generate", lm.ref, settings, prompt, len(ids), [], **ran)


def files_note(lm: LoadedModel) -> str:
    """--stats' words on how the model's folder stores its weights, and its size."""
    if lm.disk_bytes is None:
        return ""
    return f"weights {lm.storage or 'unknown'}, {lm.disk_bytes / 1e6:.1f} MB on disk"


def result_json(lm: LoadedModel, finish: Finish, prefill: Prefill | None,
                tokens: Sequence[Token] = ()) -> dict[str, Any]:
    """One output as JSON (docs/output.md); with `tokens` carrying details (--logprobs),
    a `logprobs` object in the OpenAI/vLLM shape."""
    from cli import output

    prefill_s = prefill.seconds if prefill is not None else 0.0
    extra: dict[str, Any] = {}
    if tokens and tokens[0].detail is not None:
        from genlib.lab.explain import logprobs_content

        extra["logprobs"] = logprobs_content(lm, tokens)
    return output.finish_output(finish, finish.row + 1, prefill_s, **extra)


def rerank_json(event: Rerank, prefill: Prefill | None) -> dict[str, Any]:
    """Sample and rerank in the JSON document (docs/output.md): the method, what its
    score means, the chosen sample's number and every sample with its score."""
    from cli import output
    from genlib.decoding.rerank import SCORES, method_kind

    prefill_s = prefill.seconds if prefill is not None else 0.0
    samples = [output.finish_output(f, i + 1, prefill_s, score=score, chosen=i == event.chosen)
               for i, (f, score) in enumerate(zip(event.samples, event.scores))]
    return {"method": event.method, "score": SCORES[method_kind(event.method)],
            "chosen": event.chosen + 1, "seconds": round(event.seconds, 6),
            "samples": samples}


def detail_for(logprobs: int | None, color_by: str | None) -> Detail | None:
    """The per-step record --logprobs / --color-by ask for (None: none, at no cost)."""
    from genlib.decoding.detail import Detail

    if not logprobs and color_by is None:
        return None
    return Detail(logprobs=logprobs or 0)


def run_generation(lm: LoadedModel, ids: list[int], prompt: str,
                   settings: GenerationSettings, sink: Sink, show_stats: bool,
                   logprobs: int | None = None, color_by: str | None = None,
                   scorer: LoadedModel | None = None, backend: str = "auto") -> int:
    """Stream one prompt's outputs on the user's `backend`; return the exit code (130 if
    interrupted, 1 if an output ended before its grammar was complete). With
    `settings.samples`, the chosen sample streams once chosen, and the document lists
    every sample (`rerank_json`)."""
    from cli import output, render
    from genlib.backends.choose import architecture
    from genlib.decoding.step import collect
    from genlib.events import Finish, Prefill, Rerank, Token
    from genlib.generate import stream

    live = not sink.machine and settings.num_return_sequences == 1
    prefill: Prefill | None = None
    reranked: Rerank | None = None
    finished: list[Finish] = []
    tokens: dict[int, list[Token]] = {}
    if color_by is not None and live:
        render_tokens.legend(color_by)

    def handle(event: Any) -> None:
        nonlocal prefill, reranked
        if isinstance(event, Prefill):
            prefill = event
        elif isinstance(event, Rerank):
            reranked = event
        elif isinstance(event, Token):
            if event.detail is not None:
                tokens.setdefault(event.row, []).append(event)
            if live:
                render_tokens.stream_token(event, color_by)
        elif isinstance(event, Finish):
            finished.append(event)
            if live:
                render.stream_text(event.tail)
            extra = {"rerank": rerank_json(reranked, prefill)} if reranked else {}
            sink.json_line(output.line(run_document(lm, prompt, ids, settings, prefill),
                                       result_json(lm, event, prefill,
                                                   tokens.get(event.row, ())), **extra))

    detail = detail_for(logprobs, color_by)
    _, interrupted = collect(stream(lm, [ids], settings, detail=detail, scorer=scorer,
                                    backend=backend), handle)
    interrupted = interrupted or any(f.reason == "interrupted" for f in finished)
    if live:
        render.end_line()  # before --stats, which would otherwise follow the text
    ordered = sorted(finished, key=lambda f: f.row)
    doc = run_document(lm, prompt, ids, settings, prefill)
    doc["outputs"] = [result_json(lm, f, prefill, tokens.get(f.row, ())) for f in ordered]
    if reranked is not None:
        doc["rerank"] = rerank_json(reranked, prefill)
    sink.json_document(doc)
    if show_stats and reranked is not None:
        from cli import render_rerank

        render_rerank.scores(reranked)
    for finish in ordered:
        if not sink.machine:
            if not live:
                render.stream_text(text_block(finish.row, finish.text))
            if logprobs:  # --json and --jsonl hold them
                render_tokens.logprobs_table(lm, tokens.get(finish.row, ()), settings)
        if show_stats:  # on stderr, whatever stdout holds
            render.stats(finish.new_tokens, finish.ttft, finish.tokens_per_second, finish.reason,
                         backend_note(prefill), architecture(lm) if prefill else "",
                         files_note(lm))
    return exit_code([f.reason for f in finished], settings.max_new_tokens, interrupted)


def text_block(row: int, text: str) -> str:
    """An output as plain text, on stdout and in -o FILE alike: its line ended, and a
    blank line before each output after the first (--num-return-sequences)."""
    return ("\n" if row else "") + text + "\n"


def backend_note(prefill: Prefill | None) -> str:
    """--stats' words on the backend that ran, and why it was chosen."""
    if prefill is None or not prefill.backend:
        return ""
    return f"{prefill.backend} ({prefill.backend_reason})"


@user_errors
@opt.options(("ensemble", opt.DECODING + opt.RERANK + opt.SAMPLERS + opt.CONSTRAINTS),
             ("amateur", ("ensemble_mode",)),
             ("as_json", ("cd_beta", "cd_alpha") + opt.PROMPT_OPTIONS),
             ("compile", opt.MODEL_OPTIONS))
def generate(
    prompt: opt.Prompt = None,
    model: opt.Model = None,
    preset: opt.Preset = None,
    ensemble: opt.Ensemble = None,
    amateur: opt.Amateur = None,
    as_json: Json = False,
    as_jsonl: Jsonl = False,
    output: Annotated[str | None, typer.Option(
        "--output", "-o", rich_help_panel=opt.OUTPUT_PANEL, metavar="FILE",
        help="Write what would go to stdout (the text, or the JSON with --json/--jsonl) to "
        "FILE instead; stderr is unchanged. With --input, the JSONL results (what `-` "
        "sends to stdout; rerunning resumes the file).")] = None,
    logprobs: opt.Logprobs = None,
    color_by: opt.ColorBy = None,
    show_settings: opt.ShowSettings = False,
    show_stats: Annotated[bool, typer.Option(
        "--stats", help="Print tokens, time to first token and tokens/s to stderr.")] = False,
    compile: opt.RetiredCompile = False,
    interactive: Annotated[bool, typer.Option(
        "--interactive", "-i", help="Interactive session: load the model once, then type "
        "prompts (/help lists the commands).")] = False,
    input_file: Annotated[Path | None, typer.Option(
        "--input", help="JSONL file of prompts to generate for in batches (`-` = stdin).")
    ] = None,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", help="Rows per forward pass with --input (default 16).")] = None,
    retry_errors: Annotated[bool, typer.Option(
        "--retry-errors", help="With --input: generate again the lines whose earlier "
        "result in --output is an error.")] = False,
    redo_changed: Annotated[bool, typer.Option(
        "--redo-changed", help="With --input: generate again the lines whose prompt or "
        "settings changed since their result in --output was written (otherwise "
        "refused).")] = False,
    engine: Annotated[str, typer.Option(
        "--engine", help="Where --input runs: local (this process) or ray (the workers of "
        "a Ray cluster; needs the ray extra).")] = "local",
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="--engine ray: the cluster to join, auto (the one `ray start` "
        "runs here) or the head's HOST:PORT (default: start a private one on this "
        "machine).")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", help="--engine ray: workers, each with the model loaded (default: one "
        "per CPU of the cluster, or per GPU with --device cuda).")] = None,
    batch_format: Annotated[str, typer.Option(
        "--format", help="--input/--output lines: auto (detected per file), genlab, or "
        "openai (OpenAI's Batch format, as vLLM's run-batch reads and writes).")] = "auto",
    **given: Any,
) -> None:
    """Generate text for a prompt, streamed token by token.

    Examples:\n
      genlab generate "def fibonacci(n):"\n
      echo "Once upon a time" | genlab generate -m ../shared/models/stories260K -p creative\n
      genlab generate "Hello" --json -n 20 --seed 1 -t 0.8
    """
    flags = opt.given_settings(given, prompt, input_file, interactive)
    opt.refuse_compile(compile)
    model_flags = opt.model_flags(given, model, ensemble, amateur)
    combined = combination_defaults(model_flags, flags)
    from cli.batch import EngineFlags

    engine_flags = EngineFlags(engine, ray_address, workers, batch_format)
    if (interactive or input_file is not None or batch_size is not None
            or retry_errors or redo_changed or engine_flags.given()):
        from cli import batch as batch_cmd

        batch_cmd.check_modes(prompt, interactive, input_file, output, batch_size,
                              {"--json": as_json, "--jsonl": as_jsonl, "--stats": show_stats,
                               "--truncate-prompt": given["truncate_prompt"],
                               # --input lines take it (each result line's logprobs)
                               "--logprobs": bool(logprobs) and input_file is None,
                               "--color-by": color_by is not None,
                               "--show-settings": show_settings},
                              {"--retry-errors": retry_errors, "--redo-changed": redo_changed},
                              engine_flags)
        if interactive:
            from cli import repl

            return repl.run(flags, preset, model_flags, given["chat"], given["system"], combined)
        return batch_cmd.run(flags, preset, model_flags, input_file, output, batch_size,
                             given["chat"], given["system"],
                             batch_cmd.ResumeFlags(redo_changed, retry_errors),
                             engine_flags, logprobs or 0, combined)
    render_tokens.check_color_by(color_by)
    sink(as_json, as_jsonl, output)  # refuses --json with --jsonl before any work
    settings, loaded_preset = settings_for(preset, flags, combined)
    text = read_prompt(prompt)
    scorer = load_scorer(model_flags, settings)  # an unknown --rerank fails before loading
    lm = load(model_flags, loaded_preset)
    if show_settings:
        show_settings_table(settings, flags, loaded_preset, lm)
    ids = encode_prompt(lm, text, opt.prompt_flags(given), settings.max_new_tokens)
    prepare_grammar(lm, settings)
    with opened(sink(as_json, as_jsonl, output)) as target:
        target.messages = chat_messages(text, opt.prompt_flags(given))
        code = run_generation(lm, ids, text, settings, target, show_stats, logprobs, color_by,
                              scorer, model_flags.backend)
    if code:
        raise typer.Exit(code)
