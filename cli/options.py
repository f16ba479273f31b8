"""Options shared by several subcommands, defined once.

Setting flags default to None, meaning "not given", so `resolve_settings` can apply
the precedence explicit flag > preset > built-in default.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli import output

MODEL_PANEL = "Model"
DECODING_PANEL = "Decoding"
OUTPUT_PANEL = "Output"

Model = Annotated[str | None, typer.Option(
    "--model", "-m", rich_help_panel=MODEL_PANEL,
    help="Hub id, local folder, or a built-in model: builtin:code-small, builtin:code-tiny. "
         "Default: the preset's model, else $GENLAB_MODEL, else builtin:code-small.")]
Device = Annotated[str, typer.Option(
    "--device", rich_help_panel=MODEL_PANEL, help="auto, cpu, cuda or mps.")]
Dtype = Annotated[str, typer.Option(
    "--dtype", rich_help_panel=MODEL_PANEL,
    help="auto, float32, bfloat16 or float16 (auto: float32 on CPU, bfloat16 on GPU).")]
Quantize = Annotated[str, typer.Option(
    "--quantize", rich_help_panel=MODEL_PANEL, help="none, 8bit or 4bit (bitsandbytes NF4).")]
TrustRemoteCode = Annotated[bool, typer.Option(
    "--trust-remote-code", rich_help_panel=MODEL_PANEL,
    help="Allow model code from the hub to run.")]
Preset = Annotated[str | None, typer.Option(
    "--preset", "-p", rich_help_panel=DECODING_PANEL,
    help="Preset name (see `genlab presets list`) or path to a .yaml file.")]

Strategy = Annotated[str | None, typer.Option(
    "--strategy", "-s", rich_help_panel=DECODING_PANEL, help="greedy, sample or beam.")]
MaxNewTokens = Annotated[int | None, typer.Option(
    "--max-new-tokens", "-n", rich_help_panel=DECODING_PANEL, help="Tokens to generate at most.")]
MinNewTokens = Annotated[int | None, typer.Option(
    "--min-new-tokens", rich_help_panel=DECODING_PANEL, help="No end token before this many.")]
Temperature = Annotated[float | None, typer.Option(
    "--temperature", "-t", rich_help_panel=DECODING_PANEL,
    help="Sampling temperature (> 0). Implies sampling unless --strategy says otherwise.")]
TopK = Annotated[int | None, typer.Option(
    "--top-k", rich_help_panel=DECODING_PANEL, help="Keep the k most probable tokens.")]
TopP = Annotated[float | None, typer.Option(
    "--top-p", rich_help_panel=DECODING_PANEL, help="Nucleus sampling mass, 0 < p <= 1.")]
MinP = Annotated[float | None, typer.Option(
    "--min-p", rich_help_panel=DECODING_PANEL, help="Drop tokens with p < min_p * p_max.")]
TypicalP = Annotated[float | None, typer.Option(
    "--typical-p", rich_help_panel=DECODING_PANEL, help="Locally typical sampling mass.")]
RepetitionPenalty = Annotated[float | None, typer.Option(
    "--repetition-penalty", rich_help_panel=DECODING_PANEL,
    help="> 1 discourages tokens already in the context.")]
NoRepeatNgram = Annotated[int | None, typer.Option(
    "--no-repeat-ngram-size", rich_help_panel=DECODING_PANEL,
    help="Never repeat an n-gram of this size.")]
Stop = Annotated[list[str] | None, typer.Option(
    "--stop", rich_help_panel=DECODING_PANEL,
    help="Stop string (repeatable; \\n and \\t escapes work); it is not printed.")]
Seed = Annotated[int | None, typer.Option(
    "--seed", rich_help_panel=DECODING_PANEL, help="Random seed for sampling.")]
NumReturn = Annotated[int | None, typer.Option(
    "--num-return-sequences", rich_help_panel=DECODING_PANEL, help="Outputs per prompt.")]
MaxTime = Annotated[float | None, typer.Option(
    "--max-time", rich_help_panel=DECODING_PANEL, help="Stop after this many seconds.")]
IgnoreEos = Annotated[bool | None, typer.Option(
    "--ignore-eos", rich_help_panel=DECODING_PANEL, help="Never stop at an end token.")]

Chat = Annotated[bool, typer.Option(
    "--chat", help="Apply the tokenizer's chat template to the prompt.")]
System = Annotated[str | None, typer.Option(
    "--system", help="System message (with --chat).")]
TruncatePrompt = Annotated[bool, typer.Option(
    "--truncate-prompt", help="Keep only the prompt's last tokens if it does not fit in the "
    "model's context (default: refuse).")]

# The output flags live with the output contract (cli/output.py); here for one import.
Json, Jsonl, OutputFile = output.Json, output.Jsonl, output.OutputFile


def unescape(text: str) -> str:
    r"""Python-style escapes in a flag value: `--stop "\n\n"` means two newlines.
    ConfigError for an escape Python does not read (a lone trailing backslash, `\u`
    without four hex digits)."""
    from genlib.errors import ConfigError

    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--stop {text!r}: {exc.reason} in its escapes; write \\\\ for a "
                          f"backslash") from None


# Parameter names of the shared decoding options above -> the setting each one sets.
DECODING_PARAMS = {
    "strategy": "strategy", "max_new_tokens": "max_new_tokens",
    "min_new_tokens": "min_new_tokens", "temperature": "temperature", "top_k": "top_k",
    "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p",
    "repetition_penalty": "repetition_penalty", "no_repeat_ngram_size": "no_repeat_ngram_size",
    "stop": "stop_strings", "seed": "seed", "num_return_sequences": "num_return_sequences",
    "max_time": "max_time", "ignore_eos": "ignore_eos",
}


def decoding_flags(params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The settings given through the shared decoding options of a command, whose
    parameters are `params` (the command's `locals()`), plus the command's own `extra`."""
    picked = {setting: params[name] for name, setting in DECODING_PARAMS.items()
              if name in params}
    return setting_flags(**(picked | extra))


def setting_flags(**flags: Any) -> dict[str, Any]:
    """The settings the user gave on the command line (None = not given)."""
    if flags.get("stop_strings") == []:
        flags["stop_strings"] = None
    if flags.get("stop_strings"):
        flags["stop_strings"] = [unescape(s) for s in flags["stop_strings"]]
    if flags.get("ignore_eos") is False:
        flags["ignore_eos"] = None
    return {k: v for k, v in flags.items() if v is not None}
