"""Options shared by several subcommands, defined once.

Setting flags default to None, meaning "not given", so `resolve_settings` can apply
the precedence explicit flag > preset > built-in default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from cli import output

MODEL_PANEL = "Model"
DECODING_PANEL = "Decoding"
OUTPUT_PANEL = "Output"
SAMPLERS_PANEL = "Samplers and penalties (docs/samplers.md)"
GRAMMAR_PANEL = "Constrained output (xgrammar)"
LAYERS_PANEL = "Contrastive search and DoLa (docs/strategies.md)"

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
# Sample and rerank (genlib.decoding.rerank).
Samples = Annotated[int | None, typer.Option(
    "--samples", rich_help_panel=DECODING_PANEL, metavar="N",
    help="Draw N samples as one batch and print the one --rerank prefers (implies "
         "sampling; samples are not streamed).")]
Rerank = Annotated[str | None, typer.Option(
    "--rerank", rich_help_panel=DECODING_PANEL, metavar="METHOD",
    help="How --samples picks: logprob (best mean token logprob under the model, the "
         "default), mbr (most like the others, chrF) or a model of the same tokenizer to "
         "score with.")]

# Samplers from other tools; each help names the tool whose semantics it follows.
LogitBias = Annotated[list[str] | None, typer.Option(
    "--logit-bias", rich_help_panel=SAMPLERS_PANEL, metavar="TOKEN=BIAS",
    help="Add BIAS to TOKEN's logit; TOKEN is an id or text (repeatable; llama.cpp, OpenAI; "
         "text of several tokens biases its last token after the others, as transformers' "
         "sequence_bias).")]
PresencePenalty = Annotated[float | None, typer.Option(
    "--presence-penalty", rich_help_panel=SAMPLERS_PANEL,
    help="Subtract this from every generated token's logit, -2..2 (OpenAI, vLLM).")]
FrequencyPenalty = Annotated[float | None, typer.Option(
    "--frequency-penalty", rich_help_panel=SAMPLERS_PANEL,
    help="Subtract this times its count from each generated token's logit, -2..2 "
         "(OpenAI, vLLM).")]
DryMultiplier = Annotated[float | None, typer.Option(
    "--dry-multiplier", rich_help_panel=SAMPLERS_PANEL,
    help="DRY repetition penalty strength, 0 = off (llama.cpp).")]
DryBase = Annotated[float | None, typer.Option(
    "--dry-base", rich_help_panel=SAMPLERS_PANEL,
    help="DRY: penalty = multiplier * base^(length - allowed length), default 1.75 "
         "(llama.cpp).")]
DryAllowedLength = Annotated[int | None, typer.Option(
    "--dry-allowed-length", rich_help_panel=SAMPLERS_PANEL,
    help="DRY: repetitions this long go unpenalized, default 2 (llama.cpp).")]
DryPenaltyLastN = Annotated[int | None, typer.Option(
    "--dry-penalty-last-n", rich_help_panel=SAMPLERS_PANEL,
    help="DRY: tokens of context scanned, -1 = all, 0 = off (llama.cpp).")]
DrySequenceBreaker = Annotated[list[str] | None, typer.Option(
    "--dry-sequence-breaker", rich_help_panel=SAMPLERS_PANEL,
    help="DRY: text that ends a repetition (repeatable, replaces the default "
         "\\n : \" *; \\n escapes work; llama.cpp).")]
XtcProbability = Annotated[float | None, typer.Option(
    "--xtc-probability", rich_help_panel=SAMPLERS_PANEL,
    help="XTC: chance per step of excluding the top choices, 0 = off (llama.cpp).")]
XtcThreshold = Annotated[float | None, typer.Option(
    "--xtc-threshold", rich_help_panel=SAMPLERS_PANEL,
    help="XTC: tokens with p >= this are top choices, default 0.1 (llama.cpp).")]
TopNSigma = Annotated[float | None, typer.Option(
    "--top-n-sigma", rich_help_panel=SAMPLERS_PANEL,
    help="top-nσ: drop tokens with logit < max - n * std, 0 = off (llama.cpp).")]
EpsilonCutoff = Annotated[float | None, typer.Option(
    "--epsilon-cutoff", rich_help_panel=SAMPLERS_PANEL,
    help="Drop tokens with p < epsilon, 0 = off (transformers).")]
EtaCutoff = Annotated[float | None, typer.Option(
    "--eta-cutoff", rich_help_panel=SAMPLERS_PANEL,
    help="Drop tokens with p < min(eta, sqrt(eta) * exp(-entropy)), 0 = off (transformers).")]
Mirostat = Annotated[int | None, typer.Option(
    "--mirostat", rich_help_panel=SAMPLERS_PANEL,
    help="Mirostat version: 0 = off, 2 = Mirostat 2.0 (llama.cpp).")]
MirostatTau = Annotated[float | None, typer.Option(
    "--mirostat-tau", rich_help_panel=SAMPLERS_PANEL,
    help="Mirostat target surprise in bits, default 5 (llama.cpp).")]
MirostatEta = Annotated[float | None, typer.Option(
    "--mirostat-eta", rich_help_panel=SAMPLERS_PANEL,
    help="Mirostat learning rate, default 0.1 (llama.cpp).")]
Samplers = Annotated[str | None, typer.Option(
    "--samplers", rich_help_panel=SAMPLERS_PANEL, metavar="A;B;...",
    help="The chain's order, stage names separated by ';'; stages left out do not run "
         "(llama.cpp). Default: logit_bias; penalties; no_repeat_ngram; dry; temperature; "
         "top_k; top_p; min_p; typical_p; epsilon_cutoff; eta_cutoff; top_n_sigma; xtc; "
         "mirostat.")]

JsonSchema = Annotated[str | None, typer.Option(
    "--json-schema", rich_help_panel=GRAMMAR_PANEL, metavar="FILE|-",
    help="Constrain the output to JSON valid against this JSON schema file (`-` = stdin).")]
Regex = Annotated[str | None, typer.Option(
    "--regex", rich_help_panel=GRAMMAR_PANEL, metavar="PATTERN",
    help="Constrain the output to match this regular expression.")]
Grammar = Annotated[str | None, typer.Option(
    "--grammar", rich_help_panel=GRAMMAR_PANEL, metavar="FILE|-",
    help="Constrain the output to this EBNF/GBNF grammar file (`-` = stdin; start rule: "
         "root; llama.cpp's GBNF).")]
PenaltyAlpha = Annotated[float | None, typer.Option(
    "--penalty-alpha", rich_help_panel=LAYERS_PANEL, metavar="ALPHA",
    help="Contrastive search (Su et al. 2022, as transformers): of --top-k K candidates "
         "take the max of (1-ALPHA) * p - ALPHA * max cosine similarity of its hidden state "
         "to the context's, 0 <= ALPHA <= 1 (transformers suggests 0.6 with --top-k 4).")]
DolaLayers = Annotated[str | None, typer.Option(
    "--dola-layers", rich_help_panel=LAYERS_PANEL, metavar="low|high|N,M",
    help="DoLa (Chuang et al. 2024, as transformers): contrast the final layer with the "
         "earlier layer, of these, that differs most; low or high halves of the model, or "
         "layer numbers (0: the embeddings). The paper suggests --repetition-penalty 1.2.")]
GrammarTimeout = Annotated[float | None, typer.Option(
    "--grammar-timeout", rich_help_panel=GRAMMAR_PANEL, metavar="SECONDS",
    help="Stop with exit status 1 when the grammar takes longer than this to compile "
         "(default 30). Compiled grammars are cached on disk.")]

# Combined models (genlib.sampling.combine): the models are flags only, the numbers are settings.
COMBINE_PANEL = "Combined models (docs/combining.md)"
Ensemble = Annotated[list[str] | None, typer.Option(
    "--ensemble", rich_help_panel=COMBINE_PANEL, metavar="MODEL[:WEIGHT]",
    help="Combine this model's next-token distribution with -m's, token by token "
         "(repeatable; WEIGHT > 0, default 1, beside -m's 1; weights are normalised to sum "
         "to 1). The models must share a tokenizer.")]
EnsembleMode = Annotated[str | None, typer.Option(
    "--ensemble-mode", rich_help_panel=COMBINE_PANEL,
    help="mean (a weighted mixture of probabilities, the default) or product (a weighted "
         "product of experts, renormalised).")]
Amateur = Annotated[str | None, typer.Option(
    "--amateur", rich_help_panel=COMBINE_PANEL, metavar="MODEL",
    help="Contrastive decoding: score tokens by (1+beta) log p(-m) - beta log p(MODEL), "
         "among those -m finds plausible (Li et al. 2023). MODEL must share -m's "
         "tokenizer.")]
CdBeta = Annotated[float | None, typer.Option(
    "--cd-beta", rich_help_panel=COMBINE_PANEL,
    help="Contrastive decoding's weight on the amateur, >= 0 (default 0.5; 0: the expert "
         "alone).")]
CdAlpha = Annotated[float | None, typer.Option(
    "--cd-alpha", rich_help_panel=COMBINE_PANEL,
    help="Contrastive decoding's plausibility cutoff: keep tokens with p >= alpha * max p "
         "under -m, 0..1 (default 0.1).")]

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


# The samplers from other tools, offered alike by every command that samples: the
# command takes them as `**sampler_flags` and `sampler_options` shows them to Typer.
SAMPLER_OPTIONS: dict[str, Any] = {
    "logit_bias": LogitBias, "presence_penalty": PresencePenalty,
    "frequency_penalty": FrequencyPenalty, "dry_multiplier": DryMultiplier,
    "dry_base": DryBase, "dry_allowed_length": DryAllowedLength,
    "dry_penalty_last_n": DryPenaltyLastN, "dry_sequence_breaker": DrySequenceBreaker,
    "xtc_probability": XtcProbability, "xtc_threshold": XtcThreshold,
    "top_n_sigma": TopNSigma, "epsilon_cutoff": EpsilonCutoff, "eta_cutoff": EtaCutoff,
    "mirostat": Mirostat, "mirostat_tau": MirostatTau, "mirostat_eta": MirostatEta,
    "samplers": Samplers,
    "penalty_alpha": PenaltyAlpha, "dola_layers": DolaLayers,
}


def sampler_options(before: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command that takes `**sampler_flags` the SAMPLER_OPTIONS as parameters of
    its signature, just before its parameter `before` (where --help lists them); Typer
    reads the signature and passes them in `sampler_flags`."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(command, eval_str=True)
        shown = []
        for parameter in signature.parameters.values():
            if parameter.name == before:
                shown += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            default=None, annotation=annotation)
                          for name, annotation in SAMPLER_OPTIONS.items()]
            if parameter.kind is not inspect.Parameter.VAR_KEYWORD:
                shown.append(parameter)
        command.__signature__ = signature.replace(parameters=shown)  # type: ignore[attr-defined]
        return command
    return decorate


# Parameter names of the shared decoding options above -> the setting each one sets.
DECODING_PARAMS = {
    "strategy": "strategy", "max_new_tokens": "max_new_tokens",
    "min_new_tokens": "min_new_tokens", "temperature": "temperature", "top_k": "top_k",
    "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p",
    "repetition_penalty": "repetition_penalty", "no_repeat_ngram_size": "no_repeat_ngram_size",
    "stop": "stop_strings", "seed": "seed", "num_return_sequences": "num_return_sequences",
    "max_time": "max_time", "ignore_eos": "ignore_eos",
    "logit_bias": "logit_bias", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base", "dry_allowed_length": "dry_allowed_length",
    "dry_penalty_last_n": "dry_penalty_last_n", "dry_sequence_breaker": "dry_sequence_breakers",
    "xtc_probability": "xtc_probability", "xtc_threshold": "xtc_threshold",
    "top_n_sigma": "top_n_sigma", "epsilon_cutoff": "epsilon_cutoff",
    "eta_cutoff": "eta_cutoff", "mirostat": "mirostat", "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta", "samplers": "samplers",
    "grammar_timeout": "grammar_timeout",
    "penalty_alpha": "penalty_alpha", "dola_layers": "dola_layers",
}
# The combined models' numbers, taken by the commands that take --ensemble/--amateur
# (not speculate, whose one target model combines with nothing).
COMBINE_PARAMS = {"ensemble_mode": "ensemble_mode", "cd_beta": "cd_beta",
                  "cd_alpha": "cd_alpha"}


def decoding_flags(params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The settings given through the shared decoding options of a command, whose
    parameters are `params` (the command's `locals()`), plus the command's own `extra`."""
    picked = {setting: params[name]
              for name, setting in (DECODING_PARAMS | COMBINE_PARAMS).items() if name in params}
    check_one_stdin(params)
    picked |= grammar_flags(params.get("json_schema"), params.get("regex"),
                            params.get("grammar"))
    return setting_flags(**(picked | extra))


def check_one_stdin(params: dict[str, Any]) -> None:
    """ConfigError, before anything reads it, when two inputs of a command (`params`, its
    locals) would both come from stdin: the first would take it all, the other get
    nothing (`--input -` with `--json-schema -` ran zero lines)."""
    from genlib.errors import ConfigError

    readers = [flag for flag, name in (("--json-schema -", "json_schema"),
                                       ("--grammar -", "grammar")) if params.get(name) == "-"]
    if params.get("input_file") is not None:
        readers += ["--input -"] if str(params["input_file"]) == "-" else []
    elif "prompt" in params and params["prompt"] in (None, "-") and \
            not params.get("interactive") and (params["prompt"] == "-" or _stdin_piped()):
        readers.append("the prompt")
    if len(readers) > 1:
        raise ConfigError(f"{' and '.join(readers)} would both read stdin; give all but "
                          f"one as a file or an argument")


def _stdin_piped() -> bool:
    import sys

    return sys.stdin is not None and not sys.stdin.isatty()


def grammar_flags(json_schema: str | None, regex: str | None, grammar: str | None
                  ) -> dict[str, Any]:
    """The settings --json-schema FILE|-, --regex and --grammar FILE give (files read
    here; ConfigError naming the flag when one cannot be read)."""
    out: dict[str, Any] = {}
    if json_schema is not None:
        out["json_schema"] = _read_flag_file("--json-schema", json_schema)
    if regex is not None:
        out["regex"] = regex
    if grammar is not None:
        out["grammar"] = _read_flag_file("--grammar", grammar)
    return out


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
    """The settings the user gave on the command line (None = not given)."""
    if flags.get("stop_strings") == []:
        flags["stop_strings"] = None
    if flags.get("stop_strings"):
        flags["stop_strings"] = [unescape(s) for s in flags["stop_strings"]]
    for key in ("logit_bias", "dry_sequence_breakers"):
        if flags.get(key) == []:
            flags[key] = None
    if flags.get("dry_sequence_breakers"):
        flags["dry_sequence_breakers"] = [unescape(s) for s in flags["dry_sequence_breakers"]]
    if flags.get("ignore_eos") is False:
        flags["ignore_eos"] = None
    return {k: v for k, v in flags.items() if v is not None}
