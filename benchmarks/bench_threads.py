"""The native kernel on one thread against all of torch's threads, in one process, the
variants interleaved round by round: greedy decoding of each model, and draft-model
speculation with the target on every thread and the draft on the count under test.
This is the measurement behind running even small models' kernels on every thread
(`LeanLlama.native_step`); run it again on a machine where that choice is in doubt.

    python benchmarks/bench_threads.py [--threads 2] [--rounds 7] [--max-new-tokens 160]

Speed = new tokens / (finish - end of prefill), the median over the rounds; each
variant's tokens must be the same (the thread count never changes the bits).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = ROOT.parent / "shared" / "models"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_speculative
STORY = "Once upon a time there was a little girl"


def use_threads(lm: Any, threads: int) -> None:
    """Make `lm`'s native backend run its kernel on `threads` threads from now on."""
    from genlib.backends.kernel import WEIGHTS, NativeStep
    from genlib.backends.lean import lean_model_of

    lean = lean_model_of(lm)
    lean._native = {weights: NativeStep(lean, threads, weights=weights)
                    for weights in WEIGHTS}


def cases(max_new: int) -> dict[str, tuple[Callable[[int], None], Callable[[], Any]]]:
    """name -> (set the threads under test, run once)."""
    import torch
    from bench_speculative import CODE_PROMPT

    from genlib.decoding.speculative import speculative_stream
    from genlib.generate import stream
    from genlib.models.loading import ModelSpec, load_model
    from genlib.settings.config import resolve_settings

    settings = resolve_settings({"max_new_tokens": max_new, "ignore_eos": True})
    models = {name: load_model(ModelSpec(str(MODELS / name), device="cpu"))
              for name in ("stories260K", "code-draft", "code-target")}
    out: dict[str, tuple[Callable[[int], None], Callable[[], Any]]] = {}
    for name, lm in models.items():
        ids = lm.encode(STORY if name == "stories260K" else CODE_PROMPT)
        out[f"decode {name}"] = (lambda t, lm=lm: use_threads(lm, t),
                                 lambda lm=lm, ids=ids: stream(lm, [ids], settings))
    target, draft = models["code-target"], models["code-draft"]
    code = target.encode(CODE_PROMPT)

    def speculation_threads(t: int) -> None:
        use_threads(target, torch.get_num_threads())
        use_threads(draft, t)

    out["speculate code-target + code-draft"] = (
        speculation_threads,
        lambda: speculative_stream(target, code, settings, draft_lm=draft,
                                   num_draft_tokens=5))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args()

    import torch
    from bench_speculative import decode_rate

    torch.set_num_threads(args.threads)
    variants = (1, args.threads)
    runs = cases(args.max_new_tokens)
    rates: dict[tuple[str, int], list[float]] = {(c, t): [] for c in runs for t in variants}
    tokens: dict[str, tuple[int, ...]] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms every variant up
        for threads in variants:
            for name, (set_threads, run) in runs.items():
                set_threads(threads)
                rate, ids = decode_rate(list(run()))
                if tokens.setdefault(name, ids) != ids:
                    raise SystemExit(f"{name}: {threads} threads gave other tokens")
                if round_:
                    rates[name, threads].append(rate)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · greedy · "
          f"{args.max_new_tokens} new tokens · {args.rounds} interleaved rounds · medians")
    print(f"{'case':36s} {'1 thread':>12s} {f'{args.threads} threads':>12s} {'ratio':>7s}")
    for name in runs:
        one, many = (statistics.median(rates[name, t]) for t in variants)
        print(f"{name:36s} {one:8.0f} tok/s {many:6.0f} tok/s {many / one:6.3f}x")
    print("tokens: the same on every thread count")


if __name__ == "__main__":
    main()
