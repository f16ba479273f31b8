"""What the native kernel's many-token calls cost (genlib/backends/kernel.py, csrc/lean_step.c):

- extend: k tokens of one row in one call (speculative verification of k drafted
  tokens), as a multiple of one one-token step at the same position;
- step_rows: one token each of B rows with their own caches, tokens/s against B = 1;
- with code-draft beside code-target: code-target's step and 4-token extend right after
  three code-draft steps, as speculation calls them, against the same calls back to back;
- optionally this kernel against another build of it (`--baseline-source`, e.g. the file
  from an earlier commit that packs its weights the same way, or a trial change): the
  one-token step at `--position` and at four times it, a 4-token extend, and (on
  code-target) 8 and 32 rows, each as a ratio to the baseline. The two builds' calls
  alternate in order from round to round (baseline first, then this one first): the
  second call of a pair runs on caches the first warmed, which on this machine made
  it up to 2-3% faster, so a fixed order would show a gain that is not there.

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


def seconds(call: Callable[[], float | None], reps: int) -> float:
    """Seconds per call: a call that returns a number has timed itself (the part of it
    that counts)."""
    total = 0.0
    for _ in range(reps):
        start = clock()
        spent = call()
        total += clock() - start if spent is None else spent
    return total / reps


def after(before: Callable[[], None], call: Callable[[], None]) -> Callable[[], float]:
    """`call` timed alone, each time right after `before`."""
    def timed() -> float:
        before()
        start = clock()
        call()
        return clock() - start
    return timed


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


def run_rounds(calls: dict[Any, Callable[[], float | None]], rounds: int, reps: int,
               reverse_odd: bool = False) -> dict[Any, float]:
    """Median seconds per call of each, over `rounds` interleaved rounds; with
    `reverse_odd`, every other round runs them in the reverse order."""
    for call in calls.values():
        call()  # warm: scratch, pages, caches
    times: dict[Any, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds):
        order = list(calls.items())
        if reverse_odd and round_ % 2:
            order.reverse()
        for name, call in order:
            times[name].append(seconds(call, reps))
    return {name: statistics.median(values) for name, values in times.items()}


def print_against_step(median: dict[str, float]) -> None:
    """Each timed call but "step", in ms and as a multiple of "step"."""
    width = max(len(label) for label in median)
    for label, value in median.items():
        if label != "step":
            print(f"  {label:{width}s} {value * 1e3:7.3f} ms  {value / median['step']:5.2f}x "
                  f"a step")


def bench_extend(name: str, lean: LeanLlama, step: native.NativeStep, args: Any) -> None:
    cache = prefix(lean, step, args.position, args.position + 16)
    calls = {"step": step_at(step, cache, args.position)}
    for k in range(1, 9):
        calls[f"extend k={k}"] = extend_at(step, cache, args.position, k)
    median = run_rounds(calls, args.rounds, args.reps)
    print(f"\n{name}: extend of k tokens after {args.position} cached, {step.threads} "
          f"thread(s); one step {median['step'] * 1e3:.3f} ms")
    print_against_step(median)


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


def bench_after_draft(lean: LeanLlama, step: native.NativeStep, args: Any) -> None:
    """code-target's step and 4-token extend right after three code-draft steps, as
    speculation runs them, against the same calls back to back: between them the draft's
    weights and cache pass through the CPU's caches, which held part of the target's."""
    draft = load("code-draft")
    draft_step = draft.native_step()
    assert draft_step is not None
    cache = prefix(lean, step, args.position, args.position + 16)
    draft_cache = prefix(draft, draft_step, args.position, args.position + 16)

    def drafting() -> None:
        draft_cache.length = args.position
        for token in (5, 17, 29):
            draft_step(token, draft_cache)
            draft_cache.length += 1

    targets = {"step": step_at(step, cache, args.position),
               "extend k=4": extend_at(step, cache, args.position, 4)}
    calls: dict[str, Callable[[], float | None]] = {}
    for label, call in targets.items():
        calls[label] = call
        calls[f"{label} after 3 draft steps"] = after(drafting, call)
    median = run_rounds(calls, args.rounds, args.reps)
    print(f"\ncode-target after code-draft, {args.position} cached, {step.threads} "
          f"thread(s); one step back to back {median['step'] * 1e3:.3f} ms")
    print_against_step(median)


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
    far = min(4 * args.position, lean.cos.shape[0] - 16)
    near = prefix(lean, step, args.position, args.position + 16)
    far_cache = prefix(lean, step, far, far + 16)
    cases: dict[str, Callable[[native.NativeStep], Callable[[], None]]] = {
        f"step at {args.position}": lambda k: step_at(k, near, args.position),
        f"step at {far}": lambda k: step_at(k, far_cache, far),
        "extend k=4": lambda k: extend_at(k, near, args.position, 4)}
    if name == "code-target":
        lengths = [args.position + 8 * (b % 4) for b in range(32)]
        caches = [prefix(lean, step, length, length + 16) for length in lengths]
        for rows in (8, 32):
            cases[f"{rows} rows"] = (lambda k, rows=rows:
                                     rows_at(k, caches[:rows], lengths[:rows]))
    calls = {(case, build): make(kernel) for case, make in cases.items()
             for build, kernel in (("baseline", old), ("this", step))}
    median = run_rounds(calls, args.rounds, args.reps, reverse_odd=True)
    print(f"\n{name}: this kernel against {source}, {step.threads} thread(s), the two "
          f"builds' calls alternating first")
    for case in cases:
        base, this = median[(case, "baseline")], median[(case, "this")]
        print(f"  {case:14s} baseline {base * 1e3:7.3f} ms  this {this * 1e3:7.3f} ms  "
              f"{this / base:.3f}x its time")


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
                        help="another build of lean_step.c to time this one against")
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
                if (MODELS / "code-draft").is_dir():
                    bench_after_draft(lean, step, args)


if __name__ == "__main__":
    main()
