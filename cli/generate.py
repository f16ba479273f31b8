"""`genlab generate`: stream a completion for a prompt given as an argument or on stdin."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import options as opt
from cli.context import ModelFlags, load, settings_for
from cli.errors import INTERRUPTED, fail, user_errors
from cli.output import Json, Jsonl, Sink, opened, sink

if TYPE_CHECKING:
    from genlib.config import GenerationSettings
    from genlib.models import LoadedModel


def read_prompt(prompt: str | None) -> str:
    """The prompt argument, or stdin for `-` / no argument with piped input."""
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and sys.stdin.isatty():
        raise fail("no prompt: pass one as an argument, pipe it on stdin, or use -i")
    text = sys.stdin.read()
    if text.endswith("\n"):
        text = text[:-1]
    if not text:
        raise fail("the prompt read from stdin is empty")
    return text


def encode_prompt(lm: LoadedModel, prompt: str, chat: bool, system: str | None,
                  truncate: bool, max_new_tokens: int) -> list[int]:
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        ids = lm.encode_chat(messages)
    else:
        if system:
            raise fail("--system needs --chat")
        ids = lm.encode(prompt)
    if truncate and lm.max_positions is not None:
        room = lm.max_positions - max_new_tokens
        if room < 1:
            from genlib.errors import ContextLengthError

            raise ContextLengthError(
                f"max_new_tokens ({max_new_tokens}) leaves no room for the prompt in the "
                f"model's {lm.max_positions} positions; lower it to at most "
                f"{lm.max_positions - 1} (--truncate-prompt keeps a prompt's "
                f"last tokens in whatever room is left)")
        if len(ids) > room:
            ids = ids[:1] + ids[len(ids) - room + 1:] if lm.tokenizer.bos_token_id == ids[0] \
                else ids[len(ids) - room:]
    return ids


def with_seed(settings: GenerationSettings) -> GenerationSettings:
    """Fix a fresh seed for sampling runs without one, so --json can report it."""
    if settings.do_sample and settings.seed is None:
        from genlib.sampling import fresh_seed

        return settings.replace(seed=fresh_seed())
    return settings


def run_generation(lm: LoadedModel, ids: list[int], prompt: str,
                   settings: GenerationSettings, sink: Sink, show_stats: bool,
                   compile: bool = False) -> int:
    """Stream one prompt's outputs; return the exit code (130 if interrupted)."""
    from cli import output, render
    from genlib.decode import collect, stream
    from genlib.events import Finish, Prefill, Token

    # beam search yields only Finish events (the best beams are known at the end)
    live = not sink.machine and settings.num_return_sequences == 1 \
        and settings.strategy != "beam"
    prefill_s = 0.0
    finished: list[Finish] = []
    doc = output.run_document("generate", lm.ref, settings, prompt, len(ids), [])

    def handle(event: Any) -> None:
        nonlocal prefill_s
        if isinstance(event, Prefill):
            prefill_s = event.seconds
        elif isinstance(event, Token) and live:
            render.stream_text(event.text)
        elif isinstance(event, Finish):
            finished.append(event)
            if live:
                render.stream_text(event.tail)
            sink.json_line(output.line(doc, output.finish_output(event, event.row + 1,
                                                                 prefill_s)))

    _, interrupted = collect(stream(lm, [ids], settings, compile=compile), handle)
    interrupted = interrupted or any(f.reason == "interrupted" for f in finished)
    if live:
        render.end_line()  # before --stats, which would otherwise follow the text
    ordered = sorted(finished, key=lambda f: f.row)
    doc["outputs"] = [output.finish_output(f, f.row + 1, prefill_s) for f in ordered]
    sink.json_document(doc)
    sink.texts([f.text for f in ordered])
    for finish in ordered:
        if not live and not sink.machine:
            if finish.row:
                render.stream_text("\n")
            render.stream_text(finish.text + "\n")
        if show_stats:
            render.stats(finish.new_tokens, finish.ttft, finish.tokens_per_second, finish.reason,
                         COMPILE_NOTE if compile else "")
    return INTERRUPTED if interrupted else 0


COMPILE_NOTE = (" · tok/s includes the first run's compilation (genlab bench --compile "
                "reports it apart)")


@user_errors
def generate(
    prompt: Annotated[str | None, typer.Argument(
        help="The prompt; `-` or omitted with piped input reads stdin.")] = None,
    model: opt.Model = None,
    preset: opt.Preset = None,
    strategy: opt.Strategy = None,
    max_new_tokens: opt.MaxNewTokens = None,
    min_new_tokens: opt.MinNewTokens = None,
    temperature: opt.Temperature = None,
    top_k: opt.TopK = None,
    top_p: opt.TopP = None,
    min_p: opt.MinP = None,
    typical_p: opt.TypicalP = None,
    repetition_penalty: opt.RepetitionPenalty = None,
    no_repeat_ngram_size: opt.NoRepeatNgram = None,
    stop: opt.Stop = None,
    seed: opt.Seed = None,
    num_return_sequences: opt.NumReturn = None,
    max_time: opt.MaxTime = None,
    ignore_eos: opt.IgnoreEos = None,
    chat: opt.Chat = False,
    system: opt.System = None,
    truncate_prompt: opt.TruncatePrompt = False,
    as_json: Json = False,
    as_jsonl: Jsonl = False,
    output: Annotated[str | None, typer.Option(
        "--output", "-o", rich_help_panel=opt.OUTPUT_PANEL, metavar="FILE",
        help="Write the text, --json or --jsonl to FILE instead of stdout; with --input, "
        "the JSONL results file (`-` = stdout; rerunning resumes it).")] = None,
    show_stats: Annotated[bool, typer.Option(
        "--stats", help="Print tokens, time to first token and tokens/s to stderr.")] = False,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    quantize: opt.Quantize = "none",
    trust_remote_code: opt.TrustRemoteCode = False,
    compile: Annotated[bool, typer.Option(
        "--compile", rich_help_panel=opt.MODEL_PANEL, help="Static KV cache + torch.compile "
        "for one prompt: faster per token after a one-off compile.")] = False,
    interactive: Annotated[bool, typer.Option(
        "--interactive", "-i", help="Interactive session: load the model once, then type "
        "prompts (/help lists the commands).")] = False,
    input_file: Annotated[Path | None, typer.Option(
        "--input", help="JSONL file of prompts to generate for in batches (`-` = stdin).")
    ] = None,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", help="Rows per forward pass with --input (default 16).")] = None,
) -> None:
    """Generate text for a prompt, streamed token by token.

    Examples:\n
      genlab generate "def fibonacci(n):"\n
      echo "Once upon a time" | genlab generate -m ../shared/models/stories260K -p creative\n
      genlab generate "Hello" --json -n 20 --seed 1 -t 0.8
    """
    flags = opt.decoding_flags(locals())
    if interactive or input_file is not None or batch_size is not None:
        from cli import batch as batch_cmd

        model_flags = ModelFlags(model, device, dtype, quantize, trust_remote_code)
        batch_cmd.check_modes(prompt, interactive, input_file, output, batch_size,
                              {"--json": as_json, "--jsonl": as_jsonl, "--stats": show_stats,
                               "--truncate-prompt": truncate_prompt, "--compile": compile})
        if interactive:
            from cli import repl

            return repl.run(flags, preset, model_flags, chat, system)
        return batch_cmd.run(flags, preset, model_flags, input_file, output, batch_size,
                             chat, system)
    sink(as_json, as_jsonl, output)  # refuses --json with --jsonl before any work
    settings, loaded_preset = settings_for(preset, flags)
    settings = with_seed(settings)
    text = read_prompt(prompt)
    lm = load(ModelFlags(model, device, dtype, quantize, trust_remote_code), loaded_preset,
              quick=True)
    ids = encode_prompt(lm, text, chat, system, truncate_prompt, settings.max_new_tokens)
    with opened(sink(as_json, as_jsonl, output)) as target:
        code = run_generation(lm, ids, text, settings, target, show_stats, compile)
    if code:
        raise typer.Exit(code)
