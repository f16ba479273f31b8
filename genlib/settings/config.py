"""One frozen, validated generation-settings object, and the one function that merges
CLI flags, a preset and the built-in defaults into it.

Names follow transformers' `GenerationConfig` where one exists (`max_new_tokens`,
`top_p`, `num_beams`, `stop_strings`, ...), so settings read the same in both tools.
This module imports nothing heavy: `genlab --help` loads it without torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import reprlib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from genlib import jsonl
from genlib.errors import ConfigError

STRATEGIES = ("greedy", "sample", "beam")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
                 "eta_cutoff", "top_n_sigma", "xtc_probability", "mirostat")
# The processor chain's stages in their default order: the `samplers` vocabulary.
DEFAULT_SAMPLERS = (
    "logit_bias", "penalties", "no_repeat_ngram", "dry",
    "temperature", "top_k", "top_p", "min_p", "typical_p",
    "epsilon_cutoff", "eta_cutoff", "top_n_sigma", "xtc", "mirostat",
)
# Other names `samplers` accepts, as llama.cpp's --samplers spells them.
SAMPLER_ALIASES = {"typ_p": "typical_p", "typical": "typical_p", "temp": "temperature",
                   "nucleus": "top_p", "top-n-sigma": "top_n_sigma", "epsilon": "epsilon_cutoff",
                   "eta": "eta_cutoff", "top-k": "top_k", "top-p": "top_p", "min-p": "min_p",
                   "logit-bias": "logit_bias"}
GRAMMAR_KEYS = ("json_schema", "regex", "grammar")
PRESET_META_KEYS = ("name", "description", "model", "extends")
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes at most this
# Rows per prompt (beams, or returned sequences): each is a full copy of the KV cache, so
# a request for hundreds of thousands would take minutes and gigabytes before failing.
MAX_ROWS = 1024
MAX_SCHEMA_DEPTH = 64  # JSON levels of a json_schema; real schemas use a dozen
_SCHEMA_REFS = ("$ref", "$dynamicRef", "$recursiveRef")
_SCHEMA_DATA = ("const", "enum", "default", "examples")  # values, not schemas
_SCHEMA_NAMES = ("properties", "patternProperties", "$defs", "definitions",
                 "dependentSchemas")  # name -> schema

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict = 80, 80, 6, 6


def shown(value: Any) -> str:
    """`repr(value)`, cut short: a message quotes a bad value without echoing megabytes."""
    return _SHOW.repr(value)


# The panels `--help` groups the setting flags into.
DECODING = "Decoding"
BEAM = "Beam search"
SAMPLERS = "Samplers and penalties (docs/samplers.md)"
CONSTRAINTS = "Constrained output (xgrammar)"
LAYERS = "Contrastive search and DoLa (docs/strategies.md)"
COMBINED = "Combined models (docs/combining.md)"


@dataclass(frozen=True)
class Flag:
    """How a setting is given on the command line: its names (the long one first; Typer's
    `--on/--off` form for a switch), the `--help` panel, and what the flag's syntax adds
    to the setting's meaning (`note`: repeatable, escapes, a file to read)."""

    names: tuple[str, ...]
    panel: str = DECODING
    metavar: str | None = None
    note: str = ""
    file: bool = False  # the flag names a file (or - for stdin) that holds the value
    escapes: bool = False  # Python's backslash escapes are read: --stop "\\n\\n"


@dataclass(frozen=True)
class Spec:
    """One setting, declared once: its type, default, bounds, meaning and flag. The
    settings dataclass, preset and JSONL validation, `presets keys` and every command's
    setting options (cli/options.py) are made from it."""

    kind: str  # "int", "float", "bool", "str", "strings", "choice", "early_stopping",
    #            "bias", "samplers", "schema", "layers"
    default: Any
    help: str
    allowed: str = ""
    check: Callable[[Any], bool] | None = None
    optional: bool = False  # None is a valid value
    choices: tuple[str, ...] = ()
    flag: Flag | None = None

    def flag_help(self) -> str:
        """The flag's `--help` text: the meaning as a sentence, the bounds and the default
        (where the meaning does not say them), then the flag's note."""
        text = self.help[:1].upper() + self.help[1:] + "."
        numeric = self.kind in ("int", "float")
        bounds = [self.allowed] if numeric and self.allowed and len(self.allowed) <= 32 else []
        if numeric and self.default is not None and "default" not in self.help \
                and "= off" not in self.help:
            bounds.append(f"default {self.default}")
        if bounds:
            said = "; ".join(bounds)
            text += f" {said[:1].upper()}{said[1:]}."
        return f"{text} {self.flag.note}" if self.flag and self.flag.note else text


def _flag(*names: str, **how: Any) -> Flag:
    return Flag(names, **how)


_ESCAPES = "Repeatable; \\n and \\t escapes work."
_FILE = "The flag names a file that holds it (`-` = stdin)."

SPECS: dict[str, Spec] = {
    "strategy": Spec("choice", None,
                     "greedy, sample or beam (default: inferred from the other settings)",
                     choices=STRATEGIES, optional=True, flag=_flag("--strategy", "-s")),
    "do_sample": Spec("bool", None, "sample instead of taking the argmax (beam: beam sampling, "
                      "drawing the continuations instead of taking the best)", optional=True,
                      flag=_flag("--sample/--no-sample", panel=BEAM)),
    "max_new_tokens": Spec("int", 128, "tokens to generate at most", ">= 1", lambda v: v >= 1,
                           flag=_flag("--max-new-tokens", "-n")),
    "min_new_tokens": Spec("int", 0, "end tokens are suppressed before this many new tokens",
                           ">= 0", lambda v: v >= 0, flag=_flag("--min-new-tokens")),
    "ignore_eos": Spec("bool", False, "never stop at an end token (benchmarks)",
                       flag=_flag("--ignore-eos")),
    "temperature": Spec("float", 1.0, "divide logits by this (lower = sharper); it implies "
                        "sampling unless the strategy says otherwise",
                        "> 0 (for deterministic output use strategy greedy)",
                        lambda v: v > 0, flag=_flag("--temperature", "-t")),
    "top_k": Spec("int", 0, "keep the k most probable tokens (0 = off)", ">= 0", lambda v: v >= 0,
                  flag=_flag("--top-k")),
    "top_p": Spec("float", 1.0, "nucleus: keep the smallest set with probability >= top_p",
                  "0 < top_p <= 1", lambda v: 0 < v <= 1, flag=_flag("--top-p")),
    "min_p": Spec("float", 0.0, "drop tokens with p < min_p * p_max (0 = off)",
                  "0 <= min_p <= 1", lambda v: 0 <= v <= 1, flag=_flag("--min-p")),
    "typical_p": Spec("float", 1.0, "locally typical sampling mass (1 = off)",
                      "0 < typical_p <= 1", lambda v: 0 < v <= 1, flag=_flag("--typical-p")),
    "repetition_penalty": Spec("float", 1.0, "penalise tokens already in the context; > 1 "
                               "discourages them (1 = off)", "> 0", lambda v: v > 0,
                               flag=_flag("--repetition-penalty")),
    "no_repeat_ngram_size": Spec("int", 0, "forbid repeating any n-gram of this size (0 = off)",
                                 ">= 0", lambda v: v >= 0, flag=_flag("--no-repeat-ngram-size")),
    "stop_strings": Spec("strings", (), "stop when the text contains one of these (not printed)",
                         flag=_flag("--stop", note=_ESCAPES, escapes=True)),
    "seed": Spec("int", None, "random seed (default: a fresh one, reported in --json)",
                 f"0 <= seed <= 2**64-1 ({MAX_SEED})", lambda v: 0 <= v <= MAX_SEED,
                 optional=True, flag=_flag("--seed")),
    "num_return_sequences": Spec("int", 1, "outputs per prompt",
                                 f"1 <= num_return_sequences <= {MAX_ROWS}",
                                 lambda v: 1 <= v <= MAX_ROWS,
                                 flag=_flag("--num-return-sequences")),
    "max_time": Spec("float", None, "stop after this many seconds", "> 0", lambda v: v > 0,
                     optional=True, flag=_flag("--max-time")),
    "num_beams": Spec("int", 1, "beams kept per prompt (beam search: default 4)",
                      f"1 <= num_beams <= {MAX_ROWS}", lambda v: 1 <= v <= MAX_ROWS,
                      flag=_flag("--num-beams", "-k", panel=BEAM)),
    "length_penalty": Spec("float", 1.0, "beam score = logprob / length**length_penalty; > 0 "
                           "favours longer outputs", flag=_flag("--length-penalty", panel=BEAM)),
    "early_stopping": Spec("early_stopping", False,
                           "beam: true stops when num_beams outputs are done, false when no "
                           "running beam can still win (a heuristic), never by the exact rule "
                           "(as in transformers)", "true, false or \"never\"",
                           flag=_flag("--early-stopping", panel=BEAM)),
    "num_beam_groups": Spec("int", 1, "diverse beam search: split the beams into this many "
                            "groups", ">= 1", lambda v: v >= 1,
                            flag=_flag("--num-beam-groups", panel=BEAM)),
    "diversity_penalty": Spec("float", 0.0, "diverse beam search: penalty for tokens other groups "
                              "chose at this step", ">= 0", lambda v: v >= 0,
                              flag=_flag("--diversity-penalty", panel=BEAM)),
    "force_words": Spec("strings", (), "constrained beam search: phrases that must appear",
                        flag=_flag("--force", panel=BEAM, note="Repeatable.")),
    "force_any": Spec("strings", (), "constrained beam search: sets 'A|B|C', one of which must "
                      "appear", flag=_flag("--force-any", panel=BEAM, note="Repeatable.")),
    "logit_bias": Spec("bias", (), "add BIAS to a token's logit: TOKEN=BIAS, the token as an "
                       "id or as text (text of several tokens biases that sequence's last "
                       "token after the others, as transformers' sequence_bias; llama.cpp, "
                       "OpenAI)", flag=_flag("--logit-bias", panel=SAMPLERS, metavar="TOKEN=BIAS",
                                             note="Repeatable.")),
    "presence_penalty": Spec("float", 0.0, "subtract this from the logit of every token already "
                             "generated (OpenAI, vLLM); 0 = off", "-2 <= presence_penalty <= 2",
                             lambda v: -2 <= v <= 2,
                             flag=_flag("--presence-penalty", panel=SAMPLERS)),
    "frequency_penalty": Spec("float", 0.0, "subtract this times its count so far from each "
                              "generated token's logit (OpenAI, vLLM); 0 = off",
                              "-2 <= frequency_penalty <= 2", lambda v: -2 <= v <= 2,
                              flag=_flag("--frequency-penalty", panel=SAMPLERS)),
    "dry_multiplier": Spec("float", 0.0, "DRY repetition penalty strength (llama.cpp); 0 = off",
                           ">= 0", lambda v: v >= 0,
                           flag=_flag("--dry-multiplier", panel=SAMPLERS)),
    "dry_base": Spec("float", 1.75, "DRY: the penalty grows as base**(length - allowed_length) "
                     "(llama.cpp)", ">= 1", lambda v: v >= 1,
                     flag=_flag("--dry-base", panel=SAMPLERS)),
    "dry_allowed_length": Spec("int", 2, "DRY: repetitions up to this long go unpenalized "
                               "(llama.cpp)", ">= 1", lambda v: v >= 1,
                               flag=_flag("--dry-allowed-length", panel=SAMPLERS)),
    "dry_penalty_last_n": Spec("int", -1, "DRY: tokens of context scanned for repetitions "
                               "(llama.cpp); -1 = all, 0 = off", ">= -1", lambda v: v >= -1,
                               flag=_flag("--dry-penalty-last-n", panel=SAMPLERS)),
    "dry_sequence_breakers": Spec("strings", ("\n", ":", "\"", "*"),
                                  "DRY: texts that end a repetition (llama.cpp; default \\n : "
                                  "\" *)", flag=_flag("--dry-sequence-breaker", panel=SAMPLERS,
                                                     note=_ESCAPES + " Replaces the default.",
                                                     escapes=True)),
    "xtc_probability": Spec("float", 0.0, "XTC: chance of excluding the top choices each step "
                            "(llama.cpp); 0 = off", "0 <= xtc_probability <= 1",
                            lambda v: 0 <= v <= 1,
                            flag=_flag("--xtc-probability", panel=SAMPLERS)),
    "xtc_threshold": Spec("float", 0.1, "XTC: tokens with p >= this are top choices (llama.cpp)",
                          "0 <= xtc_threshold <= 0.5 (above 0.5 no two tokens can reach it)",
                          lambda v: 0 <= v <= 0.5,
                          flag=_flag("--xtc-threshold", panel=SAMPLERS)),
    "top_n_sigma": Spec("float", 0.0, "top-nσ: drop tokens with logit < max - n * std "
                        "(llama.cpp); 0 = off", ">= 0", lambda v: v >= 0,
                        flag=_flag("--top-n-sigma", panel=SAMPLERS)),
    "epsilon_cutoff": Spec("float", 0.0, "drop tokens with p < epsilon (transformers); 0 = off",
                           "0 <= epsilon_cutoff < 1", lambda v: 0 <= v < 1,
                           flag=_flag("--epsilon-cutoff", panel=SAMPLERS)),
    "eta_cutoff": Spec("float", 0.0, "drop tokens with p < min(eta, sqrt(eta) * exp(-entropy)) "
                       "(transformers); 0 = off", "0 <= eta_cutoff < 1", lambda v: 0 <= v < 1,
                       flag=_flag("--eta-cutoff", panel=SAMPLERS)),
    "mirostat": Spec("int", 0, "Mirostat version: 0 = off, 2 = Mirostat 2.0 (llama.cpp)",
                     "0 or 2 (Mirostat 1.0 is not implemented)", lambda v: v in (0, 2),
                     flag=_flag("--mirostat", panel=SAMPLERS)),
    "mirostat_tau": Spec("float", 5.0, "Mirostat: target surprise in bits (llama.cpp)", "> 0",
                         lambda v: v > 0,
                         flag=_flag("--mirostat-tau", panel=SAMPLERS)),
    "mirostat_eta": Spec("float", 0.1, "Mirostat: learning rate (llama.cpp)", "> 0",
                         lambda v: v > 0,
                         flag=_flag("--mirostat-eta", panel=SAMPLERS)),
    "samplers": Spec("samplers", (), "the processor chain's order, stage names separated by ';' "
                     "(llama.cpp); stages left out do not run. Default: "
                     + "; ".join(DEFAULT_SAMPLERS),
                     flag=_flag("--samplers", panel=SAMPLERS, metavar="A;B;...")),
    "json_schema": Spec("schema", None, "constrain the output to JSON valid against this "
                        "schema (xgrammar)", optional=True,
                        flag=_flag("--json-schema", panel=CONSTRAINTS, metavar="FILE|-",
                                   note=_FILE, file=True)),
    "regex": Spec("str", None, "constrain the output to match this regular expression "
                  "(xgrammar)", optional=True,
                  flag=_flag("--regex", panel=CONSTRAINTS, metavar="PATTERN")),
    "grammar": Spec("str", None, "constrain the output to this EBNF/GBNF grammar, rule root "
                    "(xgrammar)", optional=True,
                    flag=_flag("--grammar", panel=CONSTRAINTS, metavar="FILE|-",
                               note=_FILE, file=True)),
    "grammar_timeout": Spec("float", 30.0, "seconds a json_schema, regex or grammar may take "
                            "to compile before the run stops with exit status 1 (compiled "
                            "grammars are cached on disk)",
                            "> 0", lambda v: v > 0,
                            flag=_flag("--grammar-timeout", panel=CONSTRAINTS, metavar="SECONDS")),
    # Sample and rerank (genlib.decoding.rerank): one batch of `samples` rows, one output kept.
    "samples": Spec("int", None, "draw this many samples as one batch and keep the one "
                    "rerank prefers (sampling only; samples are not streamed)",
                    f"1 <= samples <= {MAX_ROWS}",
                    lambda v: 1 <= v <= MAX_ROWS, optional=True,
                    flag=_flag("--samples", metavar="N")),
    "rerank": Spec("str", None, "how samples picks its output: logprob (the best mean token "
                   "logprob under the model), mbr (minimum Bayes risk under chrF) or a "
                   "scoring model's folder or hub id (default with samples: logprob)",
                   optional=True,
                   flag=_flag("--rerank", metavar="METHOD")),
    # Combined models (genlib.sampling.combine): the settings say which combination runs, the
    # models come from --ensemble / --amateur, never from a setting.
    "ensemble_mode": Spec("choice", None, "combine the --ensemble models' next-token "
                          "distributions: mean (a weighted mixture) or product (a weighted "
                          "product of experts, renormalised); default mean with --ensemble",
                          choices=("mean", "product"), optional=True,
                          flag=_flag("--ensemble-mode", panel=COMBINED)),
    "cd_beta": Spec("float", None, "contrastive decoding: score (1+beta) log p_expert - beta "
                    "log p_amateur against the --amateur model (default 0.5 with "
                    "--amateur; 0 = the expert alone; past 1e6 the score, in float32, is "
                    "the log ratio alone)", "0 <= cd_beta <= 1e6", lambda v: 0 <= v <= 1e6,
                    optional=True,
                    flag=_flag("--cd-beta", panel=COMBINED)),
    "cd_alpha": Spec("float", 0.1, "contrastive decoding: keep only tokens with p_expert >= "
                     "alpha * max p_expert", "0 <= cd_alpha <= 1", lambda v: 0 <= v <= 1,
                     flag=_flag("--cd-alpha", panel=COMBINED)),
    "penalty_alpha": Spec("float", None, "contrastive search (Su et al. 2022, as transformers): "
                          "of the top_k candidates pick the max of (1-alpha) * p - alpha * "
                          "their hidden state's max cosine similarity to the context's "
                          "(transformers suggests 0.6 with top_k 4)",
                          "0 <= penalty_alpha <= 1", lambda v: 0 <= v <= 1, optional=True,
                          flag=_flag("--penalty-alpha", panel=LAYERS, metavar="ALPHA")),
    "dola_layers": Spec("layers", None, "DoLa (Chuang et al. 2024, as transformers): contrast "
                        "the final layer with the earlier layer, of these, that differs most: "
                        "low, high or layer numbers N,M (0: the embeddings); the paper "
                        "suggests repetition_penalty 1.2",
                        "low, high or layer numbers such as 2,4", optional=True,
                        flag=_flag("--dola-layers", panel=LAYERS, metavar="low|high|N,M")),
}


def _default(name: str) -> Any:
    """A setting's default, from SPECS: the one place defaults are written."""
    return SPECS[name].default


@dataclass(frozen=True)
class GenerationSettings:
    """Resolved, validated settings for one generation, built by `resolve_settings` (from
    flags, presets and the defaults) or directly; either way every value is checked
    (`__post_init__`). The defaults are SPECS' (strategy and do_sample hold what the
    empty settings resolve to)."""

    strategy: str = "greedy"
    do_sample: bool = False
    max_new_tokens: int = _default("max_new_tokens")
    min_new_tokens: int = _default("min_new_tokens")
    ignore_eos: bool = _default("ignore_eos")
    temperature: float = _default("temperature")
    top_k: int = _default("top_k")
    top_p: float = _default("top_p")
    min_p: float = _default("min_p")
    typical_p: float = _default("typical_p")
    repetition_penalty: float = _default("repetition_penalty")
    no_repeat_ngram_size: int = _default("no_repeat_ngram_size")
    stop_strings: tuple[str, ...] = _default("stop_strings")
    seed: int | None = _default("seed")
    num_return_sequences: int = _default("num_return_sequences")
    max_time: float | None = _default("max_time")
    num_beams: int = _default("num_beams")
    length_penalty: float = _default("length_penalty")
    early_stopping: bool | str = _default("early_stopping")
    num_beam_groups: int = _default("num_beam_groups")
    diversity_penalty: float = _default("diversity_penalty")
    force_words: tuple[str, ...] = _default("force_words")
    force_any: tuple[str, ...] = _default("force_any")
    logit_bias: tuple[tuple[int | str, float], ...] = _default("logit_bias")
    presence_penalty: float = _default("presence_penalty")
    frequency_penalty: float = _default("frequency_penalty")
    dry_multiplier: float = _default("dry_multiplier")
    dry_base: float = _default("dry_base")
    dry_allowed_length: int = _default("dry_allowed_length")
    dry_penalty_last_n: int = _default("dry_penalty_last_n")
    dry_sequence_breakers: tuple[str, ...] = _default("dry_sequence_breakers")
    xtc_probability: float = _default("xtc_probability")
    xtc_threshold: float = _default("xtc_threshold")
    top_n_sigma: float = _default("top_n_sigma")
    epsilon_cutoff: float = _default("epsilon_cutoff")
    eta_cutoff: float = _default("eta_cutoff")
    mirostat: int = _default("mirostat")
    mirostat_tau: float = _default("mirostat_tau")
    mirostat_eta: float = _default("mirostat_eta")
    samplers: tuple[str, ...] = _default("samplers")
    json_schema: str | None = _default("json_schema")
    regex: str | None = _default("regex")
    grammar: str | None = _default("grammar")
    grammar_timeout: float = _default("grammar_timeout")
    samples: int | None = _default("samples")
    rerank: str | None = _default("rerank")
    ensemble_mode: str | None = _default("ensemble_mode")
    cd_beta: float | None = _default("cd_beta")
    cd_alpha: float = _default("cd_alpha")
    penalty_alpha: float | None = _default("penalty_alpha")
    dola_layers: str | None = _default("dola_layers")
    unused: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        """Check every value as `resolve_settings` does (type, range, the cross-field
        rules), so no GenerationSettings holds a value genlab would refuse."""
        for key, spec in SPECS.items():
            value = _coerce("settings", key, spec, getattr(self, key))
            if value is None and key in ("strategy", "do_sample"):
                raise ConfigError(f"settings: {key} needs a value")
            object.__setattr__(self, key, value)
        _check_combination(self.__dict__)

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML/JSON-friendly dict of every setting (lists, not tuples)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "unused":
                continue
            value = getattr(self, f.name)
            if f.name == "logit_bias":
                value = {str(k): b for k, b in value}
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> GenerationSettings:
        """A copy with `changes` applied and validated again."""
        return resolve_settings(changes, self.to_dict())


# Other tools' names for genlab's settings (OpenAI's request fields, which OpenAI batch
# files may use; elsewhere an unknown key named so is pointed to genlab's name).
OTHER_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
               "min_tokens": "min_new_tokens", "stop": "stop_strings",
               "n": "num_return_sequences"}


def closest_key(key: str, valid: Iterable[str]) -> str | None:
    if len(key) > 64:  # no setting name is this long, and difflib would be slow on it
        return None
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return match[0] if match else None


def _type_error(source: str, key: str, spec: Spec, value: Any) -> ConfigError:
    wanted = {"int": "an integer", "float": "a number", "bool": "true or false",
              "str": "a string", "strings": "a string or a list of strings",
              "choice": f"one of {', '.join(spec.choices)}",
              "early_stopping": "true, false or \"never\"",
              "bias": "TOKEN=BIAS strings or a mapping of token to bias",
              "samplers": "stage names separated by ';' or a list of them",
              "schema": "a JSON schema (an object, or its JSON text)",
              "layers": "low, high or layer numbers such as 2,4"}[spec.kind]
    return ConfigError(f"{source}: {key} must be {wanted}, got {shown(value)}")


def _coerce(source: str, key: str, spec: Spec, value: Any) -> Any:
    """Check one value's type and range; return it in canonical form."""
    if value is None:
        if spec.optional:
            return None
        raise ConfigError(f"{source}: {key} needs a value ({spec.allowed or spec.help})")
    bad = jsonl.lone_surrogate(value)  # a flag's bytes that are not UTF-8 arrive so
    if bad is not None:
        raise ConfigError(f"{source}: {key} holds {bad}, which is not text (a byte that is "
                          f"not UTF-8, or half of a surrogate pair); give it as UTF-8 text")
    kind = spec.kind
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(source, key, spec, value)
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(source, key, spec, value)
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{source}: {key} must be a finite number, got {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise _type_error(source, key, spec, value)
    elif kind == "str":
        if not isinstance(value, str):
            raise _type_error(source, key, spec, value)
    elif kind == "strings":
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise _type_error(source, key, spec, value)
        if any(v == "" for v in value):
            raise ConfigError(f"{source}: {key} must not contain an empty string")
        value = tuple(value)
    elif kind == "choice":
        if value not in spec.choices:
            hint = closest_key(str(value), spec.choices)
            extra = f" (did you mean {hint!r}?)" if hint else ""
            raise ConfigError(f"{source}: {key} must be one of {', '.join(spec.choices)}, "
                              f"got {shown(value)}{extra}")
    elif kind == "early_stopping":
        if isinstance(value, str) and value.lower() == "never":  # as True and TRUE read
            value = "never"
        if not (isinstance(value, bool) or value == "never"):
            raise _type_error(source, key, spec, value)
    elif kind == "bias":
        value = _coerce_bias(source, key, value)
    elif kind == "samplers":
        value = _coerce_samplers(source, key, value)
    elif kind == "schema":
        value = _coerce_schema(source, key, value)
    elif kind == "layers":
        value = _coerce_layers(source, key, value)
    if spec.check is not None and not spec.check(value):
        raise ConfigError(f"{source}: {key} must be {spec.allowed}, got {shown(value)}")
    return value


def _coerce_bias(source: str, key: str, value: Any) -> tuple[tuple[int | str, float], ...]:
    """logit_bias as ((token, bias), ...): a mapping, or TOKEN=BIAS strings (split at the
    last '='); a token of digits alone is an id, any other text is encoded."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)):
        pairs = []
        for item in value:
            if isinstance(item, (list, tuple)) and len(item) == 2:
                pairs.append(tuple(item))
                continue
            token, sep, bias = str(item).rpartition("=")
            if not sep or not token:
                raise ConfigError(f"{source}: {key} wants TOKEN=BIAS, got {shown(item)}")
            pairs.append((token, bias))
    else:
        raise _type_error(source, key, SPECS[key], value)
    out: list[tuple[int | str, float]] = []
    for token, bias in pairs:
        try:
            number = float(bias)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: {key} for {shown(token)} must be a number, got "
                              f"{shown(bias)}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{source}: {key} for {shown(token)} must be finite, "
                              f"got {shown(bias)}")
        if isinstance(token, int) and not isinstance(token, bool):
            token_key: int | str = token
        elif isinstance(token, str) and token.isascii() and token.isdigit():
            token_key = int(token)  # "²" and "٣" are digits to isdigit(), and text here
        elif isinstance(token, str) and token:
            token_key = token
        else:
            raise ConfigError(f"{source}: {key} tokens are ids or non-empty text, "
                              f"got {shown(token)}")
        out.append((token_key, number))
    return tuple(out)


def _coerce_samplers(source: str, key: str, value: Any) -> tuple[str, ...]:
    """samplers as a tuple of canonical stage names: 'a;b;c' (or commas) or a list."""
    if isinstance(value, str):
        value = [v for v in value.replace(",", ";").split(";") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _type_error(source, key, SPECS[key], value)
    names: list[str] = []
    for raw in value:
        name = SAMPLER_ALIASES.get(raw.strip(), raw.strip())
        if name not in DEFAULT_SAMPLERS:
            hint = closest_key(name, DEFAULT_SAMPLERS)
            extra = f" (did you mean {hint!r}?)" if hint else ""
            raise ConfigError(f"{source}: {key} has no stage {shown(raw)}{extra}; stages: "
                              f"{';'.join(DEFAULT_SAMPLERS)}")
        if name in names:
            raise ConfigError(f"{source}: {key} names {shown(name)} twice")
        names.append(name)
    return tuple(names)


def _coerce_layers(source: str, key: str, value: Any) -> str:
    """dola_layers as "low", "high" or layer numbers "N,M" (from text, a number or a
    list of numbers)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise _type_error(source, key, SPECS[key], value)
    text = value.strip().lower()
    if text in ("low", "high"):
        return text
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise ConfigError(f"{source}: {key} must be low, high or layer numbers such as 2,4, "
                          f"got {shown(value)}")
    return ",".join(str(int(p)) for p in parts)


def layer_numbers(dola_layers: str) -> tuple[int, ...] | str:
    """A valid dola_layers' value: "low" or "high", or its layer numbers."""
    if dola_layers in ("low", "high"):
        return dola_layers
    return tuple(int(p) for p in dola_layers.split(","))


def _coerce_schema(source: str, key: str, value: Any) -> str:
    """json_schema as compact JSON text, checked to be a valid JSON schema."""
    if isinstance(value, str):
        try:
            value = json.loads(value, parse_int=jsonl.read_integer)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: {key} is not valid JSON: {exc}") from None
        except RecursionError:
            raise _schema_too_deep(source, key) from None
        except jsonl.LongInteger as exc:
            raise ConfigError(f"{source}: {key} holds an integer of {exc.digits:,} digits, "
                              f"more than Python reads; no schema needs one") from None
    if not isinstance(value, (Mapping, bool)):
        raise _type_error(source, key, SPECS[key], value)
    _check_schema_shape(source, key, value)
    try:
        import jsonschema

        jsonschema.validators.validator_for(value).check_schema(value)
    except ImportError:
        pass  # xgrammar reports what it cannot read when the grammar is compiled
    except jsonschema.SchemaError as exc:
        raise ConfigError(f"{source}: {key} is not a valid JSON schema: {exc.message}") from None
    return json.dumps(value, separators=(",", ":"))


def _schema_too_deep(source: str, key: str) -> ConfigError:
    return ConfigError(f"{source}: {key} is nested deeper than {MAX_SCHEMA_DEPTH} levels; "
                       f"flatten it (name its parts in $defs and refer to them with "
                       f"\"$ref\": \"#/$defs/NAME\")")


def _check_schema_shape(source: str, key: str, schema: Any) -> None:
    """Refuse what the grammar compiler would not honour or could not afford: a `$ref`
    outside the schema (a file or URL: xgrammar resolves only "#..." refs and would drop
    the constraint with a warning; a schema from an input line must open nothing), and
    nesting deeper than MAX_SCHEMA_DEPTH (compiling takes time and memory that grow as
    its cube). Walked with an explicit stack; data (const, enum, ...) is not schema, and
    the members of `properties` (...) are schemas whatever their names."""
    stack: list[tuple[Any, int, bool]] = [(schema, 1, False)]  # (node, depth, names)
    while stack:
        node, depth, names = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _schema_too_deep(source, key)
        if isinstance(node, list):
            stack.extend((child, depth + 1, False) for child in node)
        elif isinstance(node, Mapping) and names:
            stack.extend((child, depth + 1, False) for child in node.values())
        elif isinstance(node, Mapping):
            for name, child in node.items():
                if name in _SCHEMA_REFS and isinstance(child, str) \
                        and not child.startswith("#"):
                    raise ConfigError(f"{source}: {key} has {name} {shown(child)}, outside "
                                      f"the schema; only refs inside it (\"#/$defs/NAME\") "
                                      f"are followed: copy what it names into $defs")
                if name not in _SCHEMA_DATA:
                    stack.append((child, depth + 1, name in _SCHEMA_NAMES))


def validate_settings(data: Mapping[str, Any], source: str,
                      extra_keys: Iterable[str] = ()) -> dict[str, Any]:
    """Validate a mapping of settings (from YAML, flags, a JSONL line...).

    Unknown keys are rejected naming `source`, the key and the closest valid key.
    Keys in `extra_keys` pass through unchecked (e.g. preset metadata).
    """
    extra = set(extra_keys)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: setting names must be strings, got {shown(key)}")
        if key in extra:
            out[key] = value
            continue
        spec = SPECS.get(key)
        if spec is None:
            hint = OTHER_NAMES.get(key) or closest_key(key, [*SPECS, *extra])
            extra_msg = f" (did you mean {hint!r}?)" if hint else ""
            raise ConfigError(f"{source}: unknown setting {shown(key)}{extra_msg}; "
                              f"`genlab presets keys` lists them all")
        out[key] = _coerce(source, key, spec, value)
    return out


class SettingsLoader(yaml.SafeLoader):
    """safe_load with YAML 1.2's numbers, for settings (KEY=VALUE and presets): PyYAML
    reads YAML 1.1's, where 1:30 is 90 (base 60) and 010 is 8 (octal). Here 1:30 is
    text and 010 is 10; 0o17 and 0x1f are octal and hex, as YAML 1.2 writes them."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
SettingsLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
SettingsLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
SettingsLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def _yaml_12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    base = {"0o": 8, "0x": 16}.get(text[:2], 10)
    return int(text[2:] if base != 10 else text, base)


SettingsLoader.add_constructor(_INT, _yaml_12_int)


def parse_value(key: str, text: str, source: str = "value") -> Any:
    """Type a `KEY=VALUE` string the way YAML 1.2 would (`0.7` -> float, `true` -> bool;
    `SettingsLoader`)."""
    try:
        value = yaml.load(text, Loader=SettingsLoader) if text.strip() else None  # noqa: S506
    except yaml.YAMLError:
        value = text
    spec = SPECS.get(key)
    if spec is not None and spec.kind in ("str", "strings", "choice") and not isinstance(
        value, (list, str)
    ):
        value = text
    return value


def parse_assignments(text: str, source: str) -> dict[str, Any]:
    """Parse `"temperature=0.7, top_p=0.9"` (or space separated) into validated settings."""
    parts = [p for chunk in text.split(",") for p in chunk.split()]
    raw: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ConfigError(f"{source}: expected KEY=VALUE, got {shown(part)}")
        key = key.strip()
        if key in raw:  # the last would win unseen, as a JSON line's repeated key would
            raise ConfigError(f"{source}: {key} is given twice; give it once")
        raw[key] = parse_value(key, value, source)
    return validate_settings(raw, source)


def _infer_strategy(explicit: Mapping[str, Any]) -> str:
    if explicit.get("strategy"):
        return explicit["strategy"]
    if explicit.get("num_beams", 1) > 1:
        return "beam"
    if "do_sample" in explicit and explicit["do_sample"] is not None:
        return "sample" if explicit["do_sample"] else "greedy"
    if explicit.get("penalty_alpha") is not None:
        return "greedy"  # contrastive search: top_k counts its candidates (transformers)
    if any(k in explicit for k in SAMPLING_KEYS) or explicit.get("samples") is not None:
        return "sample"
    return "greedy"


def resolve_settings(cli: Mapping[str, Any] | None = None,
                     preset: Mapping[str, Any] | None = None,
                     *, source: str = "command line",
                     presets: Sequence[Mapping[str, Any]] | None = None
                     ) -> GenerationSettings:
    """THE precedence rule: explicit CLI flag > preset > built-in defaults.

    `cli` holds only what the user gave (None values mean "not given" and are dropped);
    `preset` holds a preset's settings with `extends` already applied. Both are
    validated here; preset metadata keys (name, description, model) are ignored.
    A preset that samples keeps sampling under strategy beam (beam sampling) unless
    do_sample is given. Which layers count as presets for that: `presets` (later ones
    over earlier ones), for callers whose `preset` merges more than presets (batch
    lines put the run's flags between two presets); default [preset].
    """
    given_cli = {k: v for k, v in (cli or {}).items() if v is not None and v != ()}
    given_preset = {k: v for k, v in (preset or {}).items() if k not in PRESET_META_KEYS}
    explicit = {**validate_settings(given_preset, "preset"),
                **validate_settings(given_cli, source)}
    merged = {k: s.default for k, s in SPECS.items()} | explicit
    strategy = _infer_strategy(explicit)
    merged["strategy"] = strategy
    if strategy == "beam":
        # An explicit do_sample decides; otherwise a preset that samples (creative, ...)
        # keeps sampling when beams are asked for: beam sampling, with its settings.
        sampled = explicit.get("do_sample")
        merged["do_sample"] = bool(sampled) if sampled is not None else \
            _presets_sample([preset or {}] if presets is None else presets)
        if "num_beams" not in explicit:
            merged["num_beams"] = 4  # a sensible beam width; an explicit 1 is honoured
    else:
        merged["do_sample"] = strategy == "sample"
    if merged["samples"] is not None and merged["rerank"] is None:
        merged["rerank"] = "logprob"
    _check_combination(merged)
    unused = tuple(k for k in SAMPLING_KEYS if k in explicit and not merged["do_sample"]
                   and not (k == "top_k" and merged["penalty_alpha"] is not None))
    return GenerationSettings(**merged, unused=unused)


def _presets_sample(presets: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the preset layers, merged, describe sampling (creative, precise, ...)."""
    merged: dict[str, Any] = {}
    for layer in presets:
        merged.update({k: v for k, v in layer.items() if k not in PRESET_META_KEYS})
    return bool(merged) and _infer_strategy(validate_settings(merged, "preset")) == "sample"


def _check_combination(s: Mapping[str, Any]) -> None:
    """Cross-field rules; each message says how to fix it."""
    if s["strategy"] != "beam" and s["num_beams"] > 1:
        raise ConfigError(f"num_beams={s['num_beams']} needs strategy beam "
                          f"(got strategy {s['strategy']})")
    if s["strategy"] == "greedy" and s["num_return_sequences"] > 1:
        raise ConfigError("num_return_sequences > 1 gives identical greedy outputs; "
                          "use strategy sample or beam")
    if s["strategy"] == "beam":
        if s["num_return_sequences"] > s["num_beams"]:
            raise ConfigError(f"num_return_sequences ({s['num_return_sequences']}) must be "
                              f"<= num_beams ({s['num_beams']})")
        if s["num_beams"] % s["num_beam_groups"]:
            raise ConfigError(f"num_beams ({s['num_beams']}) must be divisible by "
                              f"num_beam_groups ({s['num_beam_groups']})")
        _check_length_penalty(s["length_penalty"], s["max_new_tokens"])
    if s["diversity_penalty"] > 0 and s["num_beam_groups"] == 1:
        raise ConfigError("diversity_penalty needs num_beam_groups > 1")
    if (s["force_words"] or s["force_any"]) and s["strategy"] != "beam":
        raise ConfigError("force_words/force_any need beam search (strategy beam, num_beams > 1)")
    _check_new_samplers(s)
    if s["ensemble_mode"] is not None and s["cd_beta"] is not None:
        raise ConfigError("give an ensemble (ensemble_mode) or contrastive decoding "
                          "(cd_beta), not both")
    _check_layer_methods(s)
    if s["min_new_tokens"] > s["max_new_tokens"]:
        raise ConfigError(f"min_new_tokens ({s['min_new_tokens']}) must be <= max_new_tokens "
                          f"({s['max_new_tokens']})")
    _check_rerank(s)


def _check_length_penalty(penalty: float, max_new_tokens: int) -> None:
    """length ** length_penalty must stay a finite, non-zero float at every length the
    search reaches (past that transformers' beam search fails with an OverflowError, or
    divides by zero)."""
    bound = math.log(sys.float_info.max) / math.log(max(max_new_tokens, 2))
    if abs(penalty) >= bound:
        limit = "overflow" if penalty > 0 else "vanish"
        raise ConfigError(f"length_penalty {penalty:g} makes length ** length_penalty "
                          f"{limit} within max_new_tokens ({max_new_tokens}); keep it between "
                          f"{-bound:.4g} and {bound:.4g}")


# --- The seed policy ----------------------------------------------------------------
# Every command seeds the same way: a run without --seed draws a fresh seed and reports
# it; row 0 of a generation uses the seed itself and row i a seed derived from it; a
# batch line without a seed of its own derives one from the run's seed and its id.

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes at most a signed 64-bit value


def fresh_seed() -> int:
    """A random seed for runs without --seed (reported, so the run can be repeated)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def derive_seed(seed: int, key: object) -> int:
    """A stable seed from a base seed and a key (row number, JSONL id...)."""
    digest = hashlib.sha256(f"{seed}:{key!r}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def row_seeds(base: int | None, rows: int) -> list[int]:
    """Per-row seeds of one generation: row 0 uses `base` itself (a fresh seed when
    None) and row i `derive_seed(base, i)`, so --seed S always draws the same tokens."""
    base = fresh_seed() if base is None else base
    return [base if i == 0 else derive_seed(base, i) for i in range(rows)]


def seeded(settings: GenerationSettings, seed: int | None = None) -> GenerationSettings:
    """Sampling settings with a fixed seed (`seed`, else a fresh one) when they have
    none, so a run can report and repeat it; other settings unchanged."""
    if settings.do_sample and settings.seed is None:
        return settings.replace(seed=fresh_seed() if seed is None else seed)
    return settings


# When each stage of the processor chain runs: the one place a setting turns a stage on
# (genlib.sampling.processors builds the stages these name; `samplers` must list them).
STAGE_ON: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "logit_bias": lambda s: bool(s["logit_bias"]),
    "penalties": lambda s: s["repetition_penalty"] != 1.0 or s["presence_penalty"] != 0.0
    or s["frequency_penalty"] != 0.0,
    "no_repeat_ngram": lambda s: s["no_repeat_ngram_size"] > 0,
    "dry": lambda s: s["dry_multiplier"] > 0 and s["dry_penalty_last_n"] != 0,
    "temperature": lambda s: s["temperature"] != 1.0,
    "top_k": lambda s: s["top_k"] > 0,
    "top_p": lambda s: s["top_p"] < 1.0,
    "min_p": lambda s: s["min_p"] > 0.0,
    "typical_p": lambda s: s["typical_p"] < 1.0,
    "epsilon_cutoff": lambda s: s["epsilon_cutoff"] > 0.0,
    "eta_cutoff": lambda s: s["eta_cutoff"] > 0.0,
    "top_n_sigma": lambda s: s["top_n_sigma"] > 0.0,
    "xtc": lambda s: s["xtc_probability"] > 0.0,
    "mirostat": lambda s: s["mirostat"] == 2,
}


def active_stages(s: Mapping[str, Any]) -> list[str]:
    """The stages whose settings turn them on (whatever the order or strategy)."""
    return [name for name in DEFAULT_SAMPLERS if STAGE_ON[name](s)]


def _check_new_samplers(s: Mapping[str, Any]) -> None:
    """Rules for the samplers order, Mirostat and the grammar constraints."""
    if s["samplers"]:
        left_out = [n for n in active_stages(s) if n not in s["samplers"]]
        if left_out:
            raise ConfigError(f"samplers leaves out {', '.join(left_out)}, which the settings "
                              f"turn on: add them to samplers or turn them off")
    if s["mirostat"] and s["strategy"] == "beam":
        raise ConfigError("mirostat adapts to the tokens one row samples; beam search has no "
                          "such row: drop mirostat or use strategy sample")
    grammars = [k for k in GRAMMAR_KEYS if s[k] is not None]
    if len(grammars) > 1:
        raise ConfigError(f"give one of json_schema, regex, grammar, not {' and '.join(grammars)}")
    if grammars and (s["ignore_eos"] or s["min_new_tokens"]):
        raise ConfigError(f"{grammars[0]} ends the output where the grammar ends; it cannot "
                          f"work with ignore_eos or min_new_tokens: drop them")
    if grammars and (s["force_words"] or s["force_any"]):
        raise ConfigError(f"{grammars[0]} cannot be combined with force_words/force_any")


def _check_rerank(s: Mapping[str, Any]) -> None:
    """Rules for sample and rerank (`samples`, `rerank`)."""
    samples, rerank = s["samples"], s["rerank"]
    if samples is None:
        if rerank is not None:
            raise ConfigError(f"rerank {shown(rerank)} needs samples: give --samples N "
                              f"(samples=N) to draw N samples and keep the best one")
        return
    if s["strategy"] != "sample":
        raise ConfigError(f"samples draws {samples} samples and keeps one: it needs "
                          f"strategy sample, not {s['strategy']} (greedy would draw "
                          f"{samples} identical outputs); drop strategy {s['strategy']}: "
                          f"samples implies sampling")
    if s["num_return_sequences"] > 1:
        raise ConfigError("samples keeps one output of its samples; num_return_sequences "
                          "asks for several: drop one of them")
    if rerank is not None and not rerank.strip():
        raise ConfigError("rerank is empty; give logprob, mbr or a scoring model")
    if rerank == "mbr" and samples < 2:
        raise ConfigError(f"rerank mbr compares samples with each other: give samples >= 2 "
                          f"(got {samples})")


def _check_layer_methods(s: Mapping[str, Any]) -> None:
    """Rules for contrastive search (penalty_alpha) and DoLa (dola_layers), as
    transformers draws them: contrastive search is deterministic and needs top_k
    candidates; neither runs beam search; one at a time."""
    alpha, dola = s["penalty_alpha"], s["dola_layers"]
    if alpha is not None:
        if s["strategy"] != "greedy":
            raise ConfigError(f"penalty_alpha (contrastive search) picks its tokens "
                              f"deterministically, not with strategy {s['strategy']}: drop "
                              f"penalty_alpha, or the sampling/beam settings")
        if s["top_k"] < 2:
            raise ConfigError(f"penalty_alpha (contrastive search) needs top_k >= 2 "
                              f"candidates, got top_k {s['top_k']} (transformers suggests "
                              f"penalty_alpha 0.6, top_k 4)")
    if dola is not None and s["strategy"] == "beam":
        raise ConfigError("dola_layers (DoLa) runs greedy or sampling, not beam search: drop "
                          "dola_layers or the beam settings")
    if alpha is not None and dola is not None:
        raise ConfigError("give one of penalty_alpha (contrastive search) and dola_layers "
                          "(DoLa), not both")
