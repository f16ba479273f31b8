"""How close decoding on a backend (default: native) comes to the memory-bandwidth bound
as the machine's bandwidth moves: alternately samples the read bandwidth (as `genlab
bench` does between rounds) and times a greedy generation through genlab's stream, for a
while, then reports the fraction of the bound per bandwidth band. On a machine whose
memory other tenants share, a quiet spell raises the bound; this shows whether the
decode step follows it.

    python benchmarks/bench_bound_vs_load.py [--model ../shared/models/code-target]
        [--seconds 240] [--new-tokens 256] [--backend native]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from genlib.lab import bench
from genlib.models.loading import ModelSpec, load_model
from genlib.settings.config import GenerationSettings

BANDS = ((0, 50), (50, 65), (65, 1000))  # GB/s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="../shared/models/code-target")
    parser.add_argument("--seconds", type=float, default=240)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--backend", default="native")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode speed is timed between tokens)")
    lm = load_model(ModelSpec(args.model))
    prompts = bench.exact_prompts(lm, 128, 1)
    case = bench.Case("greedy", GenerationSettings(), 128, args.new_tokens, 1,
                      backend=args.backend)
    # builds or compiles, uncounted; and says what a step reads of the weights
    weights = bench.genlab_run(lm, prompts, case).weight_bytes
    probe = bench.BandwidthProbe()
    pairs: list[tuple[float, float]] = []  # (GB/s, fraction of the bound)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        gbs = probe.sample() / 1e9
        tps = bench.genlab_run(lm, prompts, case).decode_tps  # as `genlab bench` times it
        pairs.append((gbs, tps * weights / 1e9 / gbs))
        print(f"{gbs:5.1f} GB/s  {tps:5.0f} tok/s  {100 * pairs[-1][1]:3.0f}% of the bound",
              flush=True)
    print(f"\n{weights / 1e6:.1f} MB of weights per token, {torch.get_num_threads()} threads")
    for low, high in BANDS:
        band = [f for g, f in pairs if low <= g < high]
        if band:
            print(f"bandwidth {low:3d}-{high if high < 1000 else '':3} GB/s: {len(band):3d} "
                  f"samples, median {100 * statistics.median(band):.0f}% of the bound "
                  f"[{100 * min(band):.0f}-{100 * max(band):.0f}%]")


if __name__ == "__main__":
    main()
