"""Options shared by several subcommands, defined once.

Setting flags default to None, meaning "not given", so `resolve_settings` can apply
the precedence explicit flag > preset > built-in default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import output
from genlib.settings import config

if TYPE_CHECKING:
    from cli.context import ModelFlags, PromptFlags

MODEL_PANEL = "Model"
OUTPUT_PANEL = "Output"
DECODING_PANEL, COMBINE_PANEL = config.DECODING, config.COMBINED  # the settings' panels

Prompt = Annotated[str | None, typer.Argument(
    help="The prompt; `-` or omitted with piped input reads stdin.")]
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
    "--quantize", rich_help_panel=MODEL_PANEL,
    help="none, 8bit or 4bit. On a CPU a Llama-style model runs them on the native "
         "kernel (8bit: q8_0; 4bit: nf4), which also takes q8_0, nf4 or q4_0 by name; on "
         "a GPU or with --backend transformers, bitsandbytes (4bit: NF4).")]
TrustRemoteCode = Annotated[bool, typer.Option(
    "--trust-remote-code", rich_help_panel=MODEL_PANEL,
    help="Allow model code from the hub to run.")]
Backend = Annotated[str, typer.Option(
    "--backend", rich_help_panel=MODEL_PANEL,
    help="auto, transformers, lean, compiled or native: the forward that runs the model "
         "(auto: the fastest exact one for the request; an explicit one that cannot serve it "
         "is refused).")]
RetiredCompile = Annotated[bool, typer.Option(
    "--compile", hidden=True, help="Replaced by --backend compiled / --backend native.")]


def complete_preset(incomplete: str) -> list[str]:
    """Shell completion of a preset name: the built-in and user presets (your presets
    folder) whose names start with what is typed; after a comma, the next name of a
    comma list."""
    from genlib.settings.presets import available_names

    done, _, typed = incomplete.rpartition(",")
    head = done + "," if done else ""
    return [head + name for name in available_names() if name.startswith(typed)]


Preset = Annotated[str | None, typer.Option(
    "--preset", "-p", rich_help_panel=DECODING_PANEL, autocompletion=complete_preset,
    help="Preset name (see `genlab presets list`) or path to a .yaml file.")]
# Commands that run several presets side by side (compare, bench); `preset_refs` reads it.
Presets = Annotated[list[str] | None, typer.Option(
    "--preset", "-p", rich_help_panel=DECODING_PANEL, autocompletion=complete_preset,
    help="Preset name (see `genlab presets list`) or path to a .yaml file; repeatable, or "
         "a comma list.")]

# Combined models (genlib.sampling.combine): the models are flags, not settings; the
# numbers (ensemble_mode, cd_beta, cd_alpha) are settings.
Ensemble = Annotated[list[str] | None, typer.Option(
    "--ensemble", rich_help_panel=COMBINE_PANEL, metavar="MODEL[:WEIGHT]",
    help="Combine this model's next-token distribution with -m's, token by token "
         "(repeatable; WEIGHT > 0, default 1, beside -m's 1; weights are normalised to sum "
         "to 1). The models must share a tokenizer.")]
Amateur = Annotated[str | None, typer.Option(
    "--amateur", rich_help_panel=COMBINE_PANEL, metavar="MODEL",
    help="Contrastive decoding: score tokens by (1+beta) log p(-m) - beta log p(MODEL), "
         "among those -m finds plausible (Li et al. 2023). MODEL must share -m's "
         "tokenizer.")]

Chat = Annotated[bool, typer.Option(
    "--chat", help="Apply the tokenizer's chat template to the prompt.")]
System = Annotated[str | None, typer.Option(
    "--system", help="System message (with --chat).")]
TruncatePrompt = Annotated[bool, typer.Option(
    "--truncate-prompt", help="Keep only the prompt's last tokens if it does not fit in the "
    "model's context (default: refuse).")]

Logprobs = Annotated[int | None, typer.Option(
    "--logprobs", min=0, max=20, rich_help_panel=OUTPUT_PANEL,
    help="Per token: its logprob under the raw model and the processed distribution, and "
         "the N most probable alternatives (1-20; 0 turns them off, where vLLM's 0 keeps "
         "the chosen token's; --json: a logprobs object per output, in the OpenAI/vLLM "
         "shape).")]
ColorBy = Annotated[str | None, typer.Option(
    "--color-by", rich_help_panel=OUTPUT_PANEL,
    help="Colour each streamed token by prob, entropy or rank (on a terminal; a legend "
         "goes to stderr).")]
ShowSettings = Annotated[bool, typer.Option(
    "--show-settings", rich_help_panel=OUTPUT_PANEL,
    help="List every effective setting and where it came from (stderr).")]
# The output flags live with the output contract (cli/output.py); here for one import.
Json, Jsonl, OutputFile = output.Json, output.Jsonl, output.OutputFile


def refuse_compile(given: bool) -> None:
    """The retired --compile flag: a usage error naming its replacements."""
    if given:
        from genlib.errors import ConfigError

        raise ConfigError("--compile was replaced by --backend: --backend native runs the "
                          "native kernel (auto already picks it where it applies), --backend "
                          "compiled runs torch.compile")


def comma_list(text: str | None) -> list[str]:
    """A comma list flag's items, stripped, empty ones dropped (`-p a,b`, `--models`)."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def preset_refs(given: list[str] | None) -> list[str]:
    """The presets a Presets option names, in order: each -p may be a comma list."""
    from genlib.errors import ConfigError

    refs = []
    for item in given or []:
        named = comma_list(item)
        if not named:
            raise ConfigError(f"--preset {item!r} names no preset; give a preset name or a "
                              f".yaml path")
        refs += named
    return refs


def unescape(text: str, flag: str = "--stop") -> str:
    r"""Python-style escapes in a flag value: `--stop "\n\n"` means two newlines.
    ConfigError, naming `flag`, for an escape Python does not read (a lone trailing
    backslash, `\u` without four hex digits)."""
    from genlib.errors import ConfigError

    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc.reason} in its escapes; write \\\\ for a "
                          f"backslash") from None


# --- Setting options -------------------------------------------------------------------
# Every setting flag is made from the setting's declaration (genlib.settings.config.SPECS:
# names, panel, help); a command names the settings it takes, in groups, and receives the
# given ones in `**given`, keyed by setting name.

DECODING = ("strategy", "max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p",
            "min_p", "typical_p", "repetition_penalty", "no_repeat_ngram_size",
            "stop_strings", "seed", "num_return_sequences", "max_time", "ignore_eos")
BEAM = ("num_beams", "length_penalty", "early_stopping", "num_return_sequences", "do_sample",
        "num_beam_groups", "diversity_penalty", "force_words", "force_any")
RERANK = ("samples", "rerank")
# The samplers from other tools, and the methods that read earlier layers.
SAMPLERS = ("logit_bias", "presence_penalty", "frequency_penalty", "dry_multiplier",
            "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
            "xtc_probability", "xtc_threshold", "top_n_sigma", "epsilon_cutoff", "eta_cutoff",
            "mirostat", "mirostat_tau", "mirostat_eta", "samplers", "penalty_alpha",
            "dola_layers")
CONSTRAINTS = ("json_schema", "regex", "grammar", "grammar_timeout")


def without(keys: tuple[str, ...], *left_out: str) -> tuple[str, ...]:
    """A group of settings less the ones a command does not take."""
    return tuple(key for key in keys if key not in left_out)


# The options every generating command shares that are not settings: how the model
# loads (ModelFlags) and how the prompt is made (PromptFlags); `options` places them as
# it places settings, by name.
MODEL_OPTIONS = ("device", "dtype", "quantize", "trust_remote_code", "backend")
PROMPT_OPTIONS = ("chat", "system", "truncate_prompt")
_SHARED: dict[str, tuple[Any, Any]] = {
    "device": (Device, "auto"), "dtype": (Dtype, "auto"), "quantize": (Quantize, "none"),
    "trust_remote_code": (TrustRemoteCode, False), "backend": (Backend, "auto"),
    "chat": (Chat, False), "system": (System, None), "truncate_prompt": (TruncatePrompt, False),
}


def setting_option(key: str, help_text: str | None = None) -> Any:
    """The Typer option of setting `key`, made from its declaration; `help_text` replaces
    the declared help where one command gives the flag a narrower meaning."""
    spec = config.SPECS[key]
    assert spec.flag is not None, f"setting {key} has no flag"
    if spec.kind in ("strings", "bias"):
        kind: Any = list[str]
    else:
        kind = {"int": int, "float": float, "bool": bool}.get(spec.kind, str)
    return Annotated[kind | None, typer.Option(
        *spec.flag.names, rich_help_panel=spec.flag.panel, metavar=spec.flag.metavar,
        help=help_text or spec.flag_help())]


def options(*placed: tuple[str, tuple[str, ...]], helps: dict[str, str] | None = None
            ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command that takes `**given` the options it names: settings (made from
    their declarations) and the shared MODEL_OPTIONS and PROMPT_OPTIONS. Each
    `(before, names)` puts the options of `names` just before the command's parameter
    `before` ("" for the end), where --help lists them. Typer reads the signature and
    passes the values in `given`, keyed by name; `helps` narrows a setting flag's help
    for this command."""
    def parameter(name: str) -> inspect.Parameter:
        annotation, default = _SHARED.get(name) or (
            setting_option(name, (helps or {}).get(name)), None)
        return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 default=default, annotation=annotation)

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        at = dict(placed)
        shown = []
        for declared in signature.parameters.values():
            if declared.kind is inspect.Parameter.VAR_KEYWORD:
                shown += [parameter(name) for name in at.pop("", ())]
                continue
            shown += [parameter(name) for name in at.pop(declared.name, ())]
            shown.append(declared)
        assert not at, f"{command.__name__} has no parameter {', '.join(at)}"
        command.__signature__ = signature.replace(parameters=shown)  # type: ignore[attr-defined]
        return command
    return decorate


def model_flags(given: dict[str, Any], model: str | None, ensemble: list[str] | None = None,
                amateur: str | None = None) -> ModelFlags:
    """The ModelFlags of a command's -m, --ensemble, --amateur and MODEL_OPTIONS."""
    from cli.context import ModelFlags

    return ModelFlags(model, *(given[name] for name in MODEL_OPTIONS),
                      tuple(ensemble or ()), amateur)


def prompt_flags(given: dict[str, Any]) -> PromptFlags:
    """The PromptFlags of a command's PROMPT_OPTIONS."""
    from cli.context import PromptFlags

    return PromptFlags(*(given[name] for name in PROMPT_OPTIONS))


def given_settings(given: dict[str, Any], prompt: str | None = None,
                   input_file: Any = None, interactive: bool = False) -> dict[str, Any]:
    """The settings a command's setting options gave (of `given`; None = not given), in the
    form `resolve_settings` takes: the file flags read, escapes and empty lists undone.
    The prompt, `--input` and `--interactive` say whether the prompt reads stdin too."""
    given = {key: value for key, value in given.items() if key in config.SPECS}
    check_one_stdin(given, prompt, input_file, interactive)
    flags = dict(given)
    for key, value in given.items():
        flag = config.SPECS[key].flag
        if value is not None and flag is not None and flag.file:
            flags[key] = _read_flag_file(flag.names[0], value)
    return setting_flags(**flags)


def check_one_stdin(given: dict[str, Any], prompt: str | None, input_file: Any,
                    interactive: bool) -> None:
    """ConfigError, before anything reads it, when two inputs of a command would both
    come from stdin: the first would take it all, the other get nothing (`--input -` with
    `--json-schema -` ran zero lines)."""
    from genlib.errors import ConfigError

    readers = [flag for flag, key in (("--json-schema -", "json_schema"),
                                      ("--grammar -", "grammar")) if given.get(key) == "-"]
    if input_file is not None:
        readers += ["--input -"] if str(input_file) == "-" else []
    elif prompt in (None, "-") and not interactive and (prompt == "-" or _stdin_piped()):
        readers.append("the prompt")
    if len(readers) > 1:
        raise ConfigError(f"{' and '.join(readers)} would both read stdin; give all but "
                          f"one as a file or an argument")


def _stdin_piped() -> bool:
    import sys

    return sys.stdin is not None and not sys.stdin.isatty()


def _read_flag_file(flag: str, path: str) -> str:
    import sys
    from pathlib import Path

    from genlib.errors import ConfigError

    source = "stdin" if path == "-" else path
    try:
        if path == "-":
            if sys.stdin.isatty():
                raise ConfigError(f"{flag} - reads stdin, but nothing is piped in")
            return sys.stdin.buffer.read().decode("utf-8")
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        if not path.strip():
            raise ConfigError(f"{flag} needs a file name, or - for stdin") from None
        if _looks_inline(path):
            raise ConfigError(f"{flag} takes a file name or - (stdin), not the text itself: "
                              f"put it in a file, or pipe it in and give {flag} -") from None
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag}: {source} is not UTF-8 text (byte {exc.start}); give a "
                          f"text file") from None


def _looks_inline(value: str) -> bool:
    """Whether a FILE|- value is a JSON schema or a grammar itself, not a file name."""
    return value.lstrip().startswith("{") or "::=" in value or "\n" in value


def setting_flags(**flags: Any) -> dict[str, Any]:
    """The settings given on the command line, None (and an empty list, and a switch
    whose default is off left off) meaning "not given"; escapes undone where the flag
    takes them, and --early-stopping's words read as the setting's values."""
    given = {}
    for key, value in flags.items():
        spec = config.SPECS[key]
        if value is None or value == [] or (value is False and spec.default is False):
            continue
        if spec.flag is not None and spec.flag.escapes:
            value = [unescape(text, spec.flag.names[0]) for text in value]
        elif spec.kind == "early_stopping":
            value = config.parse_value(key, value)
        given[key] = value
    return given
