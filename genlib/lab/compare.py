"""Run one prompt through several decoding strategies (or several models /
quantizations) and collect the outputs with the metrics that tell them apart.

Every strategy goes through `genlib.generate.stream` with the same loaded model, prompt
and seed; a stochastic strategy draws its samples as one batch (one row per sample,
seeds derived from the base seed). A strategy that cannot run (an unsupported setting,
a prompt that does not fit) keeps its error in its result instead of stopping the rest.

    strategies = build_strategies([], [], {"max_new_tokens": 64, "seed": 0})
    comparison = compare(lm, lm.encode("Once upon a time"), strategies)

With `logprobs` N > 0 every output of the plain loop also keeps its tokens'
log-probabilities in the OpenAI/vLLM shape (`genlib.lab.explain.logprobs_content`, the
object `generate --logprobs N` writes); beam search records none.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from genlib.errors import ConfigError, GenlabError
from genlib.events import Event, Finish, Prefill, Token
from genlib.lab import metrics
from genlib.settings.config import (
    GenerationSettings,
    parse_assignments,
    resolve_settings,
    validate_settings,
)

if TYPE_CHECKING:
    from genlib.decoding.detail import Detail
    from genlib.models.loading import LoadedModel, ModelSpec

DEFAULT_STRATEGIES: tuple[tuple[str, str], ...] = (
    ("greedy", "strategy=greedy"),
    ("beam", "strategy=beam,num_beams=4"),
    ("top-k", "top_k=40"),
    ("top-p", "top_p=0.9"),
    ("temp 0.5", "temperature=0.5"),
    ("temp 1.3", "temperature=1.3"),
)
"""(label, assignments) of the set compared when the user names none: the argmax
family (greedy, plain beam search with no n-gram blocking, so its repetition shows)
against truncated sampling and sampling at a sharpened and a flattened temperature."""


@dataclass(frozen=True)
class Strategy:
    """One column of a comparison: a label and the settings it runs with."""

    label: str
    settings: GenerationSettings
    source: str  # "preset", "variant" or "default"

    @property
    def stochastic(self) -> bool:
        return self.settings.do_sample


@dataclass(frozen=True)
class Sample:
    """One output of a strategy. `logprobs_object`: with --logprobs, its tokens'
    log-probabilities in the OpenAI/vLLM shape (None without, and for beam search)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    reason: str
    seconds: float
    score: float | None = None  # beam search's final score, when the decoder gives one
    logprobs_object: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"text": self.text, "token_ids": list(self.token_ids),
               "token_logprobs": [round(lp, 6) for lp in self.logprobs],
               "finish_reason": self.reason, "seconds": round(self.seconds, 6),
               "score": self.score}
        if self.logprobs_object is not None:
            out["logprobs"] = self.logprobs_object
        return out


@dataclass
class StrategyResult:
    """A strategy's samples and metrics, or the error that stopped it."""

    strategy: Strategy
    samples: list[Sample] = field(default_factory=list)
    metrics: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C cut the strategy's decoding short."""
        return any(s.reason == "interrupted" for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.strategy.label, "source": self.strategy.source,
                "settings": self.strategy.settings.to_dict(), "error": self.error,
                "metrics": self.metrics, "samples": [s.to_dict() for s in self.samples]}


@dataclass
class Comparison:
    """Everything `genlab compare` shows and exports."""

    model: str
    prompt: str
    prompt_tokens: int
    seed: int
    results: list[StrategyResult]
    crn: bool = True  # common random numbers (see `crn_detail`)

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C stopped it (the last result is the cut one)."""
        return any(r.interrupted for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        ok = [r.metrics for r in self.results if r.error is None]
        return {"model": self.model, "prompt": self.prompt,
                "prompt_tokens": self.prompt_tokens, "seed": self.seed,
                "random_draws": "common (inverse CDF)" if self.crn else "independent",
                "metrics": [m.key for m in metrics.METRICS],
                "best": metrics.best_values(ok),
                "strategies": [r.to_dict() for r in self.results]}


@dataclass(frozen=True)
class StrategyDone:
    """Yielded by `comparison_events` when a strategy has finished (or failed)."""

    result: StrategyResult


# --- building the set of strategies -------------------------------------------------

def strategy_from_preset(ref: str, flags: Mapping[str, Any]) -> Strategy:
    """A preset column: the common flags override the preset (flag > preset > default)."""
    from genlib.settings.presets import load_preset

    preset = load_preset(ref)
    return Strategy(preset.name, resolve_settings(flags, preset.settings), "preset")


def strategy_from_variant(assignments: str, flags: Mapping[str, Any], *,
                          label: str | None = None, source: str = "variant") -> Strategy:
    """An ad-hoc column from `"temperature=0.7,top_p=0.9"`, labelled by that string.

    The variant's own assignments win over the common flags: they are what makes this
    column different from the others.
    """
    given = parse_assignments(assignments, f"--variant {assignments!r}")
    if not given:
        raise ConfigError(f"--variant {assignments!r} sets nothing; give KEY=VALUE pairs")
    settings = resolve_settings({**flags, **given}, source=f"--variant {assignments!r}")
    return Strategy(label or assignments.strip(), settings, source)


def build_strategies(presets: Sequence[str], variants: Sequence[str],
                     flags: Mapping[str, Any], samples: int = 1) -> list[Strategy]:
    """Presets then variants, in the order given; the default set if there are none.

    `flags` are the settings common to every column (max_new_tokens, seed, ...).
    `samples` > 1 sets num_return_sequences for every stochastic strategy.
    """
    # Checked once, as the command line's: a column would name its own preset or
    # variant (the default set's `strategy=greedy`, which the user never wrote).
    validate_settings(flags, "command line")
    strategies = [strategy_from_preset(p, flags) for p in presets]
    strategies += [strategy_from_variant(v, flags) for v in variants]
    if not strategies:
        strategies = [strategy_from_variant(a, flags, label=label, source="default")
                      for label, a in DEFAULT_STRATEGIES]
    _check_unique_labels(strategies)
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    validate_settings({"num_return_sequences": samples}, "--samples")  # its upper bound
    return [with_samples(s, samples) for s in strategies]


def _check_unique_labels(strategies: Sequence[Strategy]) -> None:
    labels = [s.label for s in strategies]
    for label in labels:
        if labels.count(label) > 1:
            raise ConfigError(f"strategy {label!r} is given twice; each column needs a "
                              f"different preset or variant")


def with_samples(strategy: Strategy, samples: int) -> Strategy:
    """Stochastic strategies draw `samples` outputs; deterministic ones run once, and so
    does sample and rerank (its own `samples` setting: one kept output, its score the
    rerank's)."""
    if samples == 1 or not strategy.stochastic or strategy.settings.samples is not None:
        return strategy
    try:
        settings = strategy.settings.replace(num_return_sequences=samples)
    except ConfigError as exc:  # beam sampling: num_return_sequences <= num_beams
        raise ConfigError(f"--samples {samples} does not fit strategy {strategy.label!r}: "
                          f"{exc}") from None
    return Strategy(strategy.label, settings, strategy.source)


def sharing_seed(strategies: Sequence[Strategy], seed: int) -> list[Strategy]:
    """Give every strategy that names no seed of its own the same base seed: sample i
    of each then uses the same seed (row 0: `seed`, row i: `derive_seed(seed, i)`).
    A variant's or preset's own `seed=` is kept: comparing seeds is a comparison too."""
    return [s if s.settings.seed is not None
            else Strategy(s.label, s.settings.replace(seed=seed), s.source)
            for s in strategies]


# --- running ------------------------------------------------------------------------

def sample_seeds(seed: int, n: int) -> list[int]:
    """Seeds of the n samples: the base seed, then seeds derived from it."""
    from genlib.settings.config import row_seeds

    return row_seeds(seed, n)


def crn_detail(strategy: Strategy, crn: bool, logprobs: int = 0) -> Detail | None:
    """Common random numbers: a sampled strategy (not beam sampling) draws by inverse
    CDF from one uniform per row and step, the same stream for every strategy with the
    same seed, so columns differ by their settings, not by luck. `logprobs` N > 0 also
    records each step with the raw model's top N alternatives (the record changes no
    draw). Beam search takes no detail: None."""
    from genlib.decoding.detail import Detail

    if strategy.settings.strategy == "beam":
        return None
    inverse_cdf = crn and strategy.stochastic
    if not inverse_cdf and not logprobs:
        return None
    return Detail(record=bool(logprobs), logprobs=logprobs, inverse_cdf=inverse_cdf)


def run_strategy(lm: LoadedModel, prompt_ids: Sequence[int], strategy: Strategy,
                 crn: bool = True, logprobs: int = 0, backend: str = "auto"
                 ) -> Iterator[Event | StrategyDone]:
    """The strategy's decode events, then a StrategyDone with its result. `crn` and
    `logprobs`: see `crn_detail`; `backend`: the user's choice (--backend).

    Every row of the batch is one sample. A GenlabError (e.g. a setting the decoder
    does not support) ends the strategy with `error` set instead of propagating.
    """
    from genlib.generate import stream

    settings = strategy.settings
    seeds = None
    if strategy.stochastic and settings.seed is not None:
        seeds = sample_seeds(settings.seed, settings.num_return_sequences)
    finished: list[Finish] = []
    recorded: dict[int, list[Token]] = {}
    start = time.perf_counter()
    try:
        for event in stream(lm, [list(prompt_ids)], settings, seeds=seeds,
                            detail=crn_detail(strategy, crn, logprobs), backend=backend):
            if isinstance(event, Finish):
                finished.append(event)
            elif isinstance(event, Token) and event.detail is not None:
                recorded.setdefault(event.row, []).append(event)
            yield event
    except GenlabError as exc:
        yield StrategyDone(StrategyResult(strategy, error=str(exc)))
        return
    seconds = time.perf_counter() - start
    yield StrategyDone(summarize(strategy, finished, seconds,
                                 logprobs_objects(lm, recorded)))


def logprobs_objects(lm: LoadedModel, recorded: Mapping[int, Sequence[Token]]
                     ) -> dict[int, dict[str, Any]]:
    """Each row's recorded Token events as the OpenAI/vLLM `logprobs` object."""
    from genlib.lab.explain import logprobs_content

    return {row: logprobs_content(lm, tokens) for row, tokens in recorded.items()}


def summarize(strategy: Strategy, finished: Sequence[Finish], seconds: float,
              objects: Mapping[int, dict[str, Any]] | None = None) -> StrategyResult:
    """Samples in row order and their metrics. `seconds` is the strategy's wall time
    (prefill + every step of the batch); tokens/s is all new tokens over that time.
    `objects`: each row's `logprobs` object, where one was recorded."""
    rows = sorted(finished, key=lambda f: f.row)
    objects = objects or {}
    samples = [Sample(f.text, f.token_ids, f.logprobs, f.reason, f.end - f.start,
                      getattr(f, "score", None), objects.get(f.row)) for f in rows]
    summary = metrics.sample_set_metrics([s.token_ids for s in samples],
                                         [s.logprobs for s in samples])
    total_tokens = sum(len(s.token_ids) for s in samples)
    summary["seconds"] = seconds
    summary["tokens_per_s"] = total_tokens / seconds if seconds > 0 else None
    return StrategyResult(strategy, samples, summary)


def comparison_events(lm: LoadedModel, prompt_ids: Sequence[int],
                      strategies: Sequence[Strategy], crn: bool = True, logprobs: int = 0,
                      backend: str = "auto") -> Iterator[tuple[int, Event | StrategyDone]]:
    """(strategy index, event) for every strategy in turn, on the one loaded model.
    Ctrl-C ends the running strategy's decoding early (its rows finish "interrupted",
    its StrategyDone says so), and the comparison stops there."""
    warm_up(lm, prompt_ids, backend)
    for index, strategy in enumerate(strategies):
        for event in run_strategy(lm, prompt_ids, strategy, crn, logprobs, backend):
            yield index, event
            if isinstance(event, StrategyDone) and event.result.interrupted:
                return


def warm_up(lm: LoadedModel, prompt_ids: Sequence[int], backend: str = "auto") -> None:
    """One greedy token, untimed, before the first strategy's clock starts (and before
    each model run's, comparing models): the process's first forward, and a freshly
    loaded model's, pays for the weights' first reads and the backend's first call, which
    the first column's time and tokens/s would otherwise carry (several times the second
    column's for the same settings). A prompt the model cannot take is left for the
    strategies to report."""
    from genlib.generate import stream

    try:
        for _ in stream(lm, [list(prompt_ids)], GenerationSettings(max_new_tokens=1),
                        backend=backend):
            pass
    except GenlabError:
        pass


def compare(lm: LoadedModel, prompt_ids: Sequence[int], strategies: Sequence[Strategy],
            *, prompt: str = "", seed: int = 0, crn: bool = True, logprobs: int = 0,
            backend: str = "auto") -> Comparison:
    """Run every strategy to the end (no live display) and collect the Comparison.

    The strategies should already carry `seed` (see `sharing_seed`); it is recorded here.
    """
    results = [e.result for _, e in comparison_events(lm, prompt_ids, strategies, crn,
                                                      logprobs, backend)
               if isinstance(e, StrategyDone)]
    return Comparison(model=lm.ref, prompt=prompt, prompt_tokens=len(prompt_ids), seed=seed,
                      results=results, crn=crn)


# --- comparing models and quantizations ---------------------------------------------

@dataclass
class ModelRun:
    """One model (or quantization) on the comparison's prompt and strategy."""

    ref: str
    quantize: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    seconds: float = 0.0
    tokens_per_s: float | None = None
    weight_bytes: int | None = None
    peak_bytes: int | None = None
    first_difference: int | None = None
    agreement: float | None = None
    unit: str = "token"  # "token", or "char" when the tokenizers differ
    error: str | None = None
    finish_reason: str | None = None
    logprobs_object: dict[str, Any] | None = None  # with --logprobs (see Sample)
    backend: dict[str, str] | None = None  # the backend that ran and why (its Prefill's)

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C cut its generation short."""
        return self.finish_reason == "interrupted"

    @property
    def label(self) -> str:
        return self.ref if self.quantize == "none" else f"{self.ref} ({self.quantize})"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.ref, "quantize": self.quantize, "text": self.text,
                "token_ids": list(self.token_ids), "seconds": round(self.seconds, 6),
                "tokens_per_s": self.tokens_per_s, "weight_bytes": self.weight_bytes,
                "peak_bytes": self.peak_bytes, "first_difference": self.first_difference,
                "agreement": self.agreement, "unit": self.unit, "error": self.error,
                "finish_reason": self.finish_reason, "backend": self.backend,
                "mean_logprob": metrics.mean_logprob(self.logprobs)}


@dataclass
class ModelComparison:
    """One strategy over several models/quantizations; divergence is measured against
    the first run that succeeded (the reference)."""

    prompt: str
    strategy: Strategy
    runs: list[ModelRun]
    interrupted: bool = False  # Ctrl-C stopped it: `runs` are those before, and the cut one

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "strategy": self.strategy.label,
                "settings": self.strategy.settings.to_dict(), "interrupted": self.interrupted,
                "runs": [r.to_dict() for r in self.runs]}


def run_model(spec: ModelSpec, prompt: str, strategy: Strategy, logprobs: int = 0,
              freeze: bool = False) -> tuple[ModelRun, Any]:
    """Load one model, generate once; return the run and the tokenizer (for divergence).
    `logprobs` N > 0 keeps the tokens' logprobs object (while the model is loaded: the
    object names tokens by their text). `freeze`: freeze the heap after loading
    (`models.freeze_heap`), in a process that is genlab's alone."""
    from genlib.models.loading import display_name, freeze_heap, load_model

    run = ModelRun(display_name(spec.ref), spec.quantize)
    try:
        lm = load_model(spec, quick=True)
        if freeze:
            freeze_heap()
        prompt_ids = lm.encode(prompt)
        warm_up(lm, prompt_ids, spec.backend)  # else the first run's tokens/s carries it
        _reset_peak_memory(lm)
        finish, run.logprobs_object, prefill = generate_one(lm, prompt_ids, strategy,
                                                            logprobs, spec.backend)
    except GenlabError as exc:
        run.error = str(exc)
        return run, None
    # The decoder's clock (prefill and every step), as each output's timings: not the
    # logprobs object's bookkeeping after it.
    run.seconds = finish.end - finish.start
    run.text, run.token_ids, run.logprobs = finish.text, finish.token_ids, finish.logprobs
    run.finish_reason = finish.reason
    run.tokens_per_s = finish.new_tokens / run.seconds if run.seconds > 0 else None
    run.weight_bytes = prefill.weight_bytes if prefill is not None else None
    run.backend = {"name": prefill.backend, "reason": prefill.backend_reason} \
        if prefill is not None else None
    run.peak_bytes = _peak_memory(lm)
    return run, lm.tokenizer


def generate_one(lm: LoadedModel, prompt_ids: Sequence[int], strategy: Strategy,
                 logprobs: int = 0, backend: str = "auto"
                 ) -> tuple[Finish, dict[str, Any] | None, Prefill | None]:
    """One output of `strategy` (the first row); with `logprobs` N > 0 and a strategy
    that records them (not beam search), its logprobs object; and the Prefill event
    (the backend that ran, and the bytes of weights it holds)."""
    from genlib.decoding.detail import Detail
    from genlib.generate import stream

    record = logprobs > 0 and strategy.settings.strategy != "beam"
    detail = Detail(logprobs=logprobs) if record else None
    finished: list[Finish] = []
    recorded: dict[int, list[Token]] = {}
    prefill: Prefill | None = None
    for event in stream(lm, [list(prompt_ids)], strategy.settings, detail=detail,
                        backend=backend):
        if isinstance(event, Finish):
            finished.append(event)
        elif isinstance(event, Prefill):
            prefill = event
        elif isinstance(event, Token) and event.detail is not None:
            recorded.setdefault(event.row, []).append(event)
    first = min(finished, key=lambda f: f.row)
    return first, logprobs_objects(lm, recorded).get(first.row), prefill


def _reset_peak_memory(lm: LoadedModel) -> None:
    import torch

    if lm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(lm.device)


def _peak_memory(lm: LoadedModel) -> int | None:
    """Peak accelerator memory during generation; None on CPU, where no per-model
    figure exists (the process's peak RSS mixes every model loaded so far)."""
    import torch

    if lm.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(lm.device))
    return None


def same_tokenizer(a: Any, b: Any) -> bool:
    return a is b or (len(a) == len(b) and a.get_vocab() == b.get_vocab())


def measure_divergence(runs: Sequence[ModelRun], tokenizers: Sequence[Any]) -> None:
    """Fill first_difference/agreement of each run against the first successful one:
    over token ids when the tokenizers are the same, else over characters."""
    reference = next((i for i, r in enumerate(runs) if r.error is None), None)
    if reference is None:
        return
    ref = runs[reference]
    for run, tok in zip(runs, tokenizers):
        if run.error is not None:
            continue
        if same_tokenizer(tok, tokenizers[reference]):
            a, b, run.unit = ref.token_ids, run.token_ids, "token"
        else:
            a, b, run.unit = [ord(c) for c in ref.text], [ord(c) for c in run.text], "char"
        run.first_difference = metrics.first_difference(a, b)
        run.agreement = metrics.agreement(a, b)


def compare_models(specs: Sequence[ModelSpec], prompt: str, strategy: Strategy,
                   logprobs: int = 0, freeze: bool = False) -> ModelComparison:
    """Run `strategy` on `prompt` with each model/quantization in turn (one loaded at a
    time, so memory holds one model) and measure how far each output diverges from
    the first. `freeze`: as `run_model`'s, after each load (the CLI's)."""
    runs, tokenizers = [], []
    interrupted = False
    for spec in specs:
        try:
            run, tokenizer = run_model(spec, prompt, strategy, logprobs, freeze)
        except KeyboardInterrupt:  # Ctrl-C while loading: nothing of this run to keep
            interrupted = True
            break
        runs.append(run)
        tokenizers.append(tokenizer)
        if run.interrupted:  # Ctrl-C during its generation: stop here
            interrupted = True
            break
    measure_divergence(runs, tokenizers)
    return ModelComparison(prompt, strategy, runs, interrupted)
