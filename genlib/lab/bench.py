"""Measuring generation speed honestly: warm-up runs that do not count, a fixed number of
counted runs, prompts of exactly the requested length, outputs forced to the requested
length, and medians with their spread.

genlab's timings are read from its own event stream (`genlib.generate.stream`, the code
path `genlab generate` uses): `Prefill`, `Token` and `Finish` carry perf_counter stamps,
and `Prefill` names the backend that ran.
The transformers baseline runs `model.generate()` on the same model and inputs, timed
by a streamer that stamps each step as it arrives, interleaved run by run with
genlab's so that a noisy, shared machine slows both alike.

Peak memory is the process's resident-set high-water mark (VmHWM). Linux lets a process
reset it (`echo 5 > /proc/self/clear_refs`), so each configuration reports its own
peak; where that is not possible the reported figure is the process-wide peak so far,
and `rss_reset` says so. On CUDA the peak allocated memory is reported as well.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from genlib.backends.nocache import NoCacheBackend
from genlib.backends.sizes import step_bytes
from genlib.decoding import loop
from genlib.events import Event, Finish, Prefill, Token
from genlib.generate import stream
from genlib.models.loading import LoadedModel
from genlib.models.memory import check_memory, rows_of
from genlib.settings.config import GenerationSettings

PERCENTILES = (50, 90, 99)
FILLER = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
          "in the park with her friends. One day, she saw a big red ball under a tree. ")


@dataclass(frozen=True)
class Case:
    """One configuration to measure."""

    label: str  # strategy or preset name
    settings: GenerationSettings
    prompt_len: int
    new_tokens: int
    batch_size: int
    backend: str = "auto"  # the --backend asked for (genlib.backends.choose)
    cache: bool = True  # False: the naive loop that re-runs the whole sequence per step


@dataclass(frozen=True)
class Run:
    """Timings of one generation (all rows of a batch together), in seconds."""

    prefill_s: float
    ttft_s: float
    decode_s: float  # first token to last token
    e2e_s: float
    steps: int  # decode steps (new tokens per row)
    rows: int
    prompt_tokens: int  # all rows together
    inter_token_s: tuple[float, ...]  # gaps between consecutive steps
    token_ids: tuple[tuple[int, ...], ...]
    backend: str = ""  # the backend that ran, as its Prefill event names it
    weight_bytes: int | None = None  # the bytes of weights that backend holds (Prefill's)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first step (the first one pays for prefill)."""
        return self.rows * (self.steps - 1) / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class Result:
    """Every counted run of one case (genlab or baseline) and what was measured around it."""

    case: Case
    engine: str  # "genlab", "no-cache", "transformers"
    runs: list[Run] = field(default_factory=list)
    first_run_s: float | None = None  # the first warm-up run (includes any compilation)
    peak_rss_mb: float | None = None
    rss_reset: bool = False
    cuda_peak_mb: float | None = None

    def metrics(self) -> dict[str, Any]:
        """Medians with [min, max] over the counted runs, and pooled latency percentiles."""
        out: dict[str, Any] = {}
        for name, values in (("prefill_s", [r.prefill_s for r in self.runs]),
                             ("prefill_tps", [r.prefill_tps for r in self.runs]),
                             ("decode_tps", [r.decode_tps for r in self.runs]),
                             ("ttft_s", [r.ttft_s for r in self.runs]),
                             ("e2e_s", [r.e2e_s for r in self.runs])):
            out[name] = statistics.median(values)
            out[f"{name}_min"], out[f"{name}_max"] = min(values), max(values)
        gaps = [g for r in self.runs for g in r.inter_token_s]
        for p in PERCENTILES:
            out[f"itl_p{p}_s"] = percentile(gaps, p)
        out["new_tokens"] = self.runs[0].steps
        out["prompt_tokens"] = self.runs[0].prompt_tokens // self.runs[0].rows
        out["rows"] = self.runs[0].rows
        out["compile_s"] = (max(self.first_run_s - out["e2e_s"], 0.0)
                            if self.first_run_s is not None and self.backend == "compiled"
                            else None)
        out["peak_rss_mb"] = self.peak_rss_mb
        out["rss_reset"] = self.rss_reset
        out["cuda_peak_mb"] = self.cuda_peak_mb
        return out

    @property
    def backend(self) -> str:
        """The backend its runs ran on (from their events; transformers for the baseline)."""
        return self.runs[0].backend if self.runs else ""

    @property
    def weight_bytes(self) -> int | None:
        """The bytes of weights its backend holds, in the format it runs (each decode
        step reads them once)."""
        return self.runs[0].weight_bytes if self.runs else None


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# --- Inputs -----------------------------------------------------------------------------

def exact_prompts(lm: LoadedModel, length: int, batch_size: int) -> list[list[int]]:
    """`batch_size` prompts of exactly `length` tokens (no padding), built from English
    filler text; row i starts i tokens later in it so rows differ."""
    if length < 1:
        raise ValueError("prompt length must be at least 1")
    body = lm.encode(FILLER)
    bos = lm.tokenizer.bos_token_id
    head = [bos] if body and body[0] == bos else []
    body = body[len(head):] or [lm.pad_id]
    span = length - len(head)  # each row's text tokens: a window of the text, not its tail
    need = span + batch_size
    text_ids = (body * (need // len(body) + 1))[:need]
    return [head + text_ids[i:i + span] for i in range(batch_size)]


def check_cases(lm: LoadedModel, cases: Iterable[Case]) -> None:
    """Refuse, before any case runs, one whose prompt and new tokens do not fit in the
    model's positions, or whose rows do not fit in memory."""
    for case in cases:
        lm.check_fits(case.prompt_len, case.new_tokens)
        check_memory(lm, rows_of(case.batch_size, case.settings),
                     case.prompt_len + case.new_tokens,
                     remedy="lower --batch-size, --prompt-len or --new-tokens")


def forced_settings(settings: GenerationSettings, new_tokens: int) -> GenerationSettings:
    """`settings` made to produce exactly `new_tokens` per row: end ids, stop strings and
    time limits are switched off so runs are comparable."""
    return settings.replace(max_new_tokens=new_tokens, ignore_eos=True, min_new_tokens=0,
                            stop_strings=[], max_time=None, num_return_sequences=1)


# --- genlab's runs, timed from its events -------------------------------------------------

def run_from_events(events: Iterable[Event], start: float) -> Run:
    """Timings of one generation, read from genlab's event stream.

    Steps are counted on row 0 (every row of a forced-length batch takes each step);
    `start` is when the caller started the generation.
    """
    prefill: Prefill | None = None
    times: list[float] = []
    finishes: list[Finish] = []
    for event in events:
        if isinstance(event, Token):
            if event.row == 0:
                times.append(event.time)
        elif isinstance(event, Prefill):
            prefill = event
        elif isinstance(event, Finish):
            finishes.append(event)
    end = time.perf_counter()
    if any(f.reason == "interrupted" for f in finishes):
        raise KeyboardInterrupt  # the loop kept what it made; a bench keeps no cut run
    if prefill is None or not times:
        raise RuntimeError("the generation produced no tokens")
    finishes.sort(key=lambda f: f.row)
    return Run(prefill_s=prefill.seconds, ttft_s=times[0] - start,
               decode_s=times[-1] - times[0], e2e_s=end - start, steps=len(times),
               rows=len(finishes), prompt_tokens=sum(prefill.prompt_tokens),
               inter_token_s=tuple(b - a for a, b in zip(times, times[1:])),
               token_ids=tuple(f.token_ids for f in finishes), backend=prefill.backend,
               weight_bytes=prefill.weight_bytes)


def genlab_run(lm: LoadedModel, prompts: list[list[int]], case: Case) -> Run:
    settings = forced_settings(case.settings, case.new_tokens)
    start = time.perf_counter()
    if case.cache:
        events = stream(lm, prompts, settings, backend=case.backend)
    else:  # the naive decoder: the same loop over a backend that keeps no cache
        events = loop.decode(lm, prompts, settings, NoCacheBackend(lm))
    return run_from_events(events, start)


# --- The transformers baseline --------------------------------------------------------

class _StepClock:
    """A transformers streamer that stamps each generated step (the first `put` is the
    prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


# The stages `model.generate()` has, each run where genlib's default order runs it (that
# order is generate()'s for them: genlib.sampling.processors). "penalties" only as
# repetition_penalty: generate() has no presence or frequency penalty.
BASELINE_STAGES = ("penalties", "no_repeat_ngram", "temperature", "top_k", "top_p", "min_p",
                   "typical_p", "epsilon_cutoff", "eta_cutoff")
NO_BASELINE_KEYS = ("presence_penalty", "frequency_penalty", "json_schema", "regex",
                    "grammar", "force_words", "force_any")


def baseline_gap(settings: GenerationSettings) -> str | None:
    """What of `settings` transformers' `generate()` cannot run, in words (None: it runs
    them all, in the same order), so that the baseline never runs other settings."""
    from genlib.sampling.processors import DEFAULT_ORDER, SAMPLING_STAGES, stage_order
    from genlib.settings.config import SPECS, active_stages

    values = settings.to_dict()
    stages = [name for name in active_stages(values)
              if settings.do_sample or name not in SAMPLING_STAGES]
    missing = [key for key in NO_BASELINE_KEYS
               if getattr(settings, key) != SPECS[key].default]
    missing += [name for name in stages if name not in BASELINE_STAGES]
    if missing:
        return f"{', '.join(missing)}, which model.generate() does not have"
    order = [name for name in stage_order(settings) if name in stages]
    fixed = [name for name in DEFAULT_ORDER if name in stages]
    if order != fixed:
        return (f"the samplers order {', '.join(order)}, where model.generate() runs "
                f"{', '.join(fixed)}")
    return None


def baseline_kwargs(settings: GenerationSettings) -> dict[str, Any]:
    """The same decoding settings in `model.generate()`'s terms (`baseline_gap` says
    when there are none). Every value is passed, off ones too, so that no default of the
    model's generation_config (a hub model's top_k, say) sneaks into the baseline."""
    kwargs: dict[str, Any] = {"do_sample": settings.do_sample,
                              "repetition_penalty": settings.repetition_penalty,
                              "no_repeat_ngram_size": settings.no_repeat_ngram_size}
    if settings.do_sample:
        kwargs.update(temperature=settings.temperature, top_k=settings.top_k,
                      top_p=settings.top_p, min_p=settings.min_p or None,
                      typical_p=settings.typical_p,
                      epsilon_cutoff=settings.epsilon_cutoff or None,
                      eta_cutoff=settings.eta_cutoff or None)
    return kwargs


def baseline_run(lm: LoadedModel, prompts: list[list[int]], case: Case) -> Run:
    """transformers' `model.generate()` on the same inputs, forced to the same length.

    Batch prompts have equal lengths, so no padding is involved. `min_new_tokens` makes
    generate ignore end ids until the requested length, as `ignore_eos` does for genlab.
    """
    ids = torch.tensor(prompts, dtype=torch.long, device=lm.device)
    clock = _StepClock()
    settings = case.settings
    if settings.do_sample and settings.seed is not None:
        torch.manual_seed(settings.seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=case.new_tokens,
            min_new_tokens=case.new_tokens, pad_token_id=lm.pad_id, streamer=clock,
            **baseline_kwargs(settings))
    end = time.perf_counter()
    times = clock.times
    # generate() runs the prefill inside the first step: its prefill time is the TTFT.
    return Run(prefill_s=times[0] - start, ttft_s=times[0] - start,
               decode_s=times[-1] - times[0], e2e_s=end - start, steps=len(times),
               rows=len(prompts), prompt_tokens=ids.numel(),
               inter_token_s=tuple(b - a for a, b in zip(times, times[1:])),
               token_ids=tuple(tuple(r) for r in out[:, ids.shape[1]:].tolist()),
               backend="transformers", weight_bytes=step_bytes(lm.model))


# --- Memory ---------------------------------------------------------------------------

def reset_peak_memory(device: torch.device) -> bool:
    """Reset the peak-RSS mark (and CUDA's peak statistics); True if RSS could be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """The process's peak resident set size in MiB (VmHWM, else ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def cuda_peak_mb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


# --- The memory-bandwidth bound -----------------------------------------------------------

def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Measured read bandwidth in bytes/s: the best of `repeats` sums over a buffer larger
    than the caches, on every core this process may run on (the machine's figure,
    whatever thread count the runs use: a single core cannot saturate memory)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, usable_cores()))
    try:
        buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        buffer.sum()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return buffer.numel() * 4 / best


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    import os

    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass
class BandwidthProbe:
    """Read bandwidth sampled between the timed runs (`measure` samples it before each
    round). On a machine whose memory other tenants share, the bandwidth moves with their
    load within seconds: a bound from one measurement taken at another moment can be a
    quiet spell's or a busy one's. Sampled alongside the runs, as the baseline is run
    alongside them, the bound describes the conditions the runs had."""

    repeats: int = 3
    samples: list[float] = field(default_factory=list)  # bytes/s, in order

    def sample(self) -> float:
        value = read_bandwidth(repeats=self.repeats)
        self.samples.append(value)
        return value


# --- The runner ---------------------------------------------------------------------------

@dataclass
class Group:
    """genlab's variants of one configuration (plain, compiled, no cache) measured on the
    same prompts, and the baseline measured alongside them (when asked for)."""

    results: list[Result]
    baseline: Result | None = None
    bandwidth: list[float] = field(default_factory=list)  # bytes/s sampled between rounds

    def median_bandwidth(self) -> float | None:
        """The median of the bandwidth sampled between its rounds, bytes/s (None when it
        was not sampled)."""
        return statistics.median(self.bandwidth) if self.bandwidth else None

    def bound_tps(self, weight_bytes: int) -> float | None:
        """Decode steps/s the median sampled bandwidth allows when each step reads
        `weight_bytes` (None when the bandwidth was not sampled)."""
        bandwidth = self.median_bandwidth()
        return bandwidth / weight_bytes if bandwidth and weight_bytes else None

    def speedup(self, result: Result) -> float | None:
        """decode tokens/s of `result` over the baseline's (medians)."""
        if self.baseline is None or result is self.baseline:
            return None
        base = self.baseline.metrics()["decode_tps"]
        return result.metrics()["decode_tps"] / base if base else None

    def identical(self, result: Result) -> bool | None:
        """Whether greedy outputs matched the baseline's token for token (None: sampling,
        or no baseline)."""
        if self.baseline is None or result is self.baseline or result.case.settings.do_sample:
            return None
        return all(a.token_ids == b.token_ids
                   for a, b in zip(result.runs, self.baseline.runs))


def engine_name(case: Case) -> str:
    return "genlab" if case.cache else "no-cache"


Runner = Callable[[LoadedModel, list[list[int]], Case], Run]


def measure(lm: LoadedModel, cases: Sequence[Case], runs: int, warmup: int, baseline: bool,
            tick: Callable[[], None] = lambda: None, probe: BandwidthProbe | None = None
            ) -> Group:
    """Measure variants of one configuration (same prompt length, new tokens, batch and
    settings; the first case's are used) and the baseline on the same prompts: warm-up
    runs first (at least one for a compiled case, so compilation is never counted), then
    `runs` rounds in which every contender runs once, in turn, each round preceded by a
    bandwidth sample when there is a `probe` (outside the peak-memory windows)."""
    first = cases[0]
    check_cases(lm, [first])
    prompts = exact_prompts(lm, first.prompt_len, first.batch_size)
    group = Group([Result(c, engine_name(c)) for c in cases],
                  Result(first, "transformers") if baseline else None)
    contenders: list[tuple[Result, Runner]] = [(r, genlab_run) for r in group.results]
    if group.baseline is not None:
        contenders.append((group.baseline, baseline_run))
    for result, runner in contenders:
        _warm_up(lm, prompts, result, runner, warmup_count(lm, result, warmup), tick)
    for i in range(runs):
        if probe is not None:
            group.bandwidth.append(probe.sample())
        for result, runner in contenders:
            cold = i == 0 and result.peak_rss_mb is None  # no warm-up: take peaks now
            if cold:
                result.rss_reset = reset_peak_memory(lm.device)
            result.runs.append(runner(lm, prompts, result.case))
            if cold:
                _read_peaks(result, lm.device)
            tick()
    return group


def warmup_count(lm: LoadedModel, result: Result, warmup: int) -> int:
    """`warmup`, and at least one where the compiled backend runs (asked for, or picked
    by auto), so that compiling is never counted in a measured run."""
    return max(warmup, 1) if planned_backend(lm, result) == "compiled" else warmup


def planned_backend(lm: LoadedModel, result: Result) -> str:
    """The backend `result`'s runs will run on, before any has run."""
    from genlib.backends.choose import Request, backend_name

    if result.engine != "genlab":  # the no-cache loop and the baseline: transformers'
        return "transformers"
    case = result.case
    return backend_name(lm, Request(rows=case.batch_size, backend=case.backend))


def _warm_up(lm: LoadedModel, prompts: list[list[int]], result: Result, runner: Runner,
             count: int, tick: Callable[[], None]) -> None:
    """Uncounted runs; the first one's time is kept (it holds any compilation), and the
    peak memory is read over them."""
    if not count:
        return
    result.rss_reset = reset_peak_memory(lm.device)
    for i in range(count):
        start = time.perf_counter()
        runner(lm, prompts, result.case)
        if i == 0:
            result.first_run_s = time.perf_counter() - start
        tick()
    _read_peaks(result, lm.device)


def _read_peaks(result: Result, device: torch.device) -> None:
    result.peak_rss_mb, result.cuda_peak_mb = peak_rss_mb(), cuda_peak_mb(device)
