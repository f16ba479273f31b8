"""What per-step detail costs: tokens/s of one sampled generation without a record
(the default path), with --logprobs 5, with explain's per-stage record, and with
inverse-CDF sampling alone (compare's --crn), through genlib.generate.stream.

    python benchmarks/bench_stepdetail.py                         # stories260K
    python benchmarks/bench_stepdetail.py --model ../shared/models/code-target -n 64

Runs are interleaved (round r runs every variant once) and the medians are reported as
ratios to the default path in the same run: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260K"


def variants():
    from genlib.decoding.detail import Detail

    return {"default": None, "logprobs 5": Detail(logprobs=5),
            "explain stages": Detail(logprobs=5, stages=True, inverse_cdf=True),
            "crn only": Detail(record=False, inverse_cdf=True)}


def tokens_per_second(lm, ids, settings, detail) -> float:
    from genlib.events import Finish
    from genlib.generate import stream

    start = time.perf_counter()
    finish = [e for e in stream(lm, [ids], settings, detail=detail)
              if isinstance(e, Finish)][0]
    return finish.new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("-n", type=int, default=128, help="new tokens per run")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from genlib.models.loading import ModelSpec, load_model
    from genlib.settings.config import resolve_settings

    lm = load_model(ModelSpec(args.model), quick=True)
    ids = lm.encode("Once upon a time")
    settings = resolve_settings({"temperature": 0.8, "top_k": 40, "top_p": 0.9,
                                 "max_new_tokens": args.n, "ignore_eos": True, "seed": 0})
    runs: dict[str, list[float]] = {name: [] for name in variants()}
    tokens_per_second(lm, ids, settings, None)  # warm-up
    for _ in range(args.rounds):
        for name, detail in variants().items():
            runs[name].append(tokens_per_second(lm, ids, settings, detail))
    base = statistics.median(runs["default"])
    shown = os.path.relpath(args.model) if os.path.isabs(args.model) else args.model
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · model "
          f"{shown}, {args.n} new tokens, {args.rounds} interleaved rounds")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"{name:15s} {median:9.1f} tok/s  x{median / base:.2f}")


if __name__ == "__main__":
    main()
