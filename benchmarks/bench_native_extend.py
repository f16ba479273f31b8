"""What the native kernel's many-token calls cost (genlib/backends/kernel.py, csrc/lean_step.c):

- extend: k tokens of one row in one call (speculative verification of k drafted
  tokens), as a multiple of one one-token step at the same position;
- step_rows: one token each of B rows with their own caches, tokens/s against B = 1;
- optionally the one-token step against another build of the kernel (`--baseline-source`,
  e.g. the file from an earlier commit that packs its weights the same way), to see it
  kept its speed.

Every configuration is timed once per round, the rounds interleaved, and the medians of
the rounds reported (the machine is shared: a configuration never gets a quiet spell the
others missed). Positions start after a `--position`-token prefix.

    python benchmarks/bench_native_extend.py [--threads 2] [--rounds 7] [--position 128]
        [--clock wall|cpu] [--baseline-source old_lean_step.c]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = ROOT.parent / "shared" / "models"

from genlib.backends import kernel as native  # noqa: E402
from genlib.backends.llama import LeanLlama  # noqa: E402


def load(name: str) -> LeanLlama:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.float32).eval()
    lean = LeanLlama.from_model(model)
    assert lean is not None, f"{name} has no lean forward"
    return lean


def prefix(lean: LeanLlama, step: native.NativeStep, length: int, capacity: int) -> Any:
    cache = lean.new_cache(capacity)
    step.extend([(7 * i + 3) % step.tokens for i in range(length)], cache, all_logits=False)
    return cache


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def seconds(call: Callable[[], None], reps: int) -> float:
    start = clock()
    for _ in range(reps):
        call()
    return (clock() - start) / reps


def step_at(step: native.NativeStep, cache: Any, position: int) -> Callable[[], None]:
    def call() -> None:
        cache.length = position
        step(5, cache)
    return call


def extend_at(step: native.NativeStep, cache: Any, position: int, k: int
              ) -> Callable[[], None]:
    tokens = [(11 * i + 5) % step.tokens for i in range(k)]

    def call() -> None:
        cache.length = position
        step.extend(tokens, cache)
    return call


def rows_at(step: native.NativeStep, caches: list[Any], lengths: list[int]
            ) -> Callable[[], None]:
    tokens = [(13 * i + 5) % step.tokens for i in range(len(caches))]

    def call() -> None:
        for cache, length in zip(caches, lengths):
            cache.length = length
        step.step_rows(tokens, caches)
    return call


def run_rounds(calls: dict[str, Callable[[], None]], rounds: int, reps: int
               ) -> dict[str, float]:
    """Median seconds per call of each, over `rounds` interleaved rounds."""
    for call in calls.values():
        call()  # warm: scratch, pages, caches
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(seconds(call, reps))
    return {name: statistics.median(values) for name, values in times.items()}


def bench_extend(name: str, lean: LeanLlama, step: native.NativeStep, args: Any) -> None:
    cache = prefix(lean, step, args.position, args.position + 16)
    calls = {"step": step_at(step, cache, args.position)}
    for k in range(1, 9):
        calls[f"extend k={k}"] = extend_at(step, cache, args.position, k)
    median = run_rounds(calls, args.rounds, args.reps)
    base = median["step"]
    print(f"\n{name}: extend of k tokens after {args.position} cached, {step.threads} "
          f"thread(s); one step {base * 1e3:.3f} ms")
    for label, value in median.items():
        if label != "step":
            print(f"  {label:12s} {value * 1e3:7.3f} ms  {value / base:5.2f}x a step")


def bench_rows(name: str, lean: LeanLlama, step: native.NativeStep, args: Any) -> None:
    sizes = (1, 2, 4, 8, 16, 32)
    # Rows of different lengths, as a batch's rows are after their prompts.
    lengths = [args.position + 8 * (b % 4) for b in range(max(sizes))]
    caches = [prefix(lean, step, length, length + 16) for length in lengths]
    calls = {f"B={b}": rows_at(step, caches[:b], lengths[:b]) for b in sizes}
    median = run_rounds(calls, args.rounds, args.reps)
    one = 1 / median["B=1"]
    print(f"\n{name}: step_rows, B rows of {args.position}-{max(lengths)} cached tokens, "
          f"{step.threads} thread(s)")
    for b in sizes:
        rate = b / median[f"B={b}"]
        print(f"  B={b:<3d} {median[f'B={b}'] * 1e3:7.3f} ms a call  {rate:9.1f} tok/s  "
              f"{rate / one:5.2f}x B=1")


def bench_baseline(name: str, lean: LeanLlama, step: native.NativeStep, source: Path,
                   args: Any) -> None:
    library = native.build(native.FLAGS, source).library
    if library is None:
        raise SystemExit(f"the baseline {source} does not build")
    if not hasattr(library, "genlab_panel_rows"):
        raise SystemExit(f"the baseline {source} reads row-major weights (a kernel before "
                         "the packed panels): time it against this one with "
                         "benchmarks/bench_vs_revision.py")
    old = native.NativeStep(lean, step.threads, library)
    cache = prefix(lean, step, args.position, args.position + 16)
    median = run_rounds({"baseline": step_at(old, cache, args.position),
                         "this": step_at(step, cache, args.position)}, args.rounds, args.reps)
    print(f"\n{name}: one-token step at position {args.position}, {step.threads} "
          f"thread(s): baseline {median['baseline'] * 1e3:.3f} ms, this kernel "
          f"{median['this'] * 1e3:.3f} ms ({median['this'] / median['baseline']:.3f}x)")


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20, help="calls timed per round")
    parser.add_argument("--position", type=int, default=128)
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="cpu: the process's CPU time, which a busy machine's other "
                        "tenants do not inflate (on one thread; with more it adds up "
                        "every thread's, spinning at barriers included)")
    parser.add_argument("--baseline-source", type=Path,
                        help="another lean_step.c to time the one-token step against")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    wait = os.environ.get("OMP_WAIT_POLICY")
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{cpu_model()}, {args.threads} threads, "
          + (f"OMP_WAIT_POLICY={wait} " if wait else "")
          + f"python benchmarks/bench_native_extend.py {shlex.join(sys.argv[1:])}")
    build = native.ensure_built(lambda line: print(line, file=sys.stderr))
    if build.library is None:
        raise SystemExit(f"no native kernel here: {build.reason}")
    with torch.inference_mode():
        for name in ("code-target", "stories260K"):
            lean = load(name)
            step = lean.native_step()
            assert step is not None
            if args.baseline_source:
                bench_baseline(name, lean, step, args.baseline_source, args)
            bench_extend(name, lean, step, args)
            if name == "code-target":
                bench_rows(name, lean, step, args)


if __name__ == "__main__":
    main()
