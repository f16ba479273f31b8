"""Sample and rerank's cost: `--samples N` (N rows of one batch, then the rerank) against
one sample with the same settings, through `genlib.generate.stream` on the backend
`auto` picks (the native kernel for code-target on a CPU: one kernel call steps every
row, reading each weight once for all of them).

    python benchmarks/bench_rerank.py                     # code-target, --samples 8
    python benchmarks/bench_rerank.py --rerank mbr --rounds 7

Every sample runs to max_new_tokens (ignore_eos), so each side does a fixed amount of
work; the prompt is the code prompt of docs/performance.md. One sample and N samples run
interleaved, round by round (the order flips every round), each round with its own seed;
the figures are medians over the rounds, and the ratio is also given per round (the
machine is shared and noisy). Target from the issue: --samples 8 under 3x one sample.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "code-target"
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def timed(lm, ids: list[int], settings) -> tuple[float, float, str]:
    """Wall and CPU seconds from the call to the last event (prefill, decode, rerank),
    and the backend that ran. CPU time says more on a busy machine: waiting for a core
    costs wall time, not CPU time."""
    from genlib.events import Prefill
    from genlib.generate import stream

    backend = ""
    start, cpu = time.perf_counter(), time.process_time()
    for event in stream(lm, [ids], settings):
        if isinstance(event, Prefill):
            backend = event.backend
    return time.perf_counter() - start, time.process_time() - cpu, backend


def main() -> None:
    from genlib.models.loading import ModelSpec, load_model
    from genlib.settings.config import resolve_settings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rerank", default="logprob", help="logprob or mbr")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads, which the native kernel uses (default: torch's)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    lm = load_model(ModelSpec(args.model), quick=True)
    ids = lm.encode(PROMPT)
    common = {"temperature": 1.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    one = resolve_settings(common)
    many = resolve_settings({**common, "samples": args.samples, "rerank": args.rerank})
    timed(lm, ids, one.replace(seed=0, max_new_tokens=4))  # the first forward, untimed
    runs: dict[str, list[tuple[float, float]]] = {"one": [], "many": []}
    backend = ""
    for r in range(args.rounds):
        pair = [("one", one.replace(seed=r)), ("many", many.replace(seed=r))]
        for name, settings in pair if r % 2 == 0 else reversed(pair):
            wall, cpu, backend = timed(lm, ids, settings)
            runs[name].append((wall, cpu))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{now} · model {Path(args.model).name} · backend {backend} · {args.max_new_tokens} new "
          f"tokens a sample (ignore_eos) · temperature 1.0 · {args.rounds} interleaved "
          f"rounds · torch threads {torch.get_num_threads()}")
    for clock, k in (("wall", 0), ("CPU", 1)):
        ones = [run[k] for run in runs["one"]]
        manys = [run[k] for run in runs["many"]]
        ratios = [m / o for m, o in zip(manys, ones)]
        print(f"  {clock:<4} 1 sample {statistics.median(ones):.3f} s (min {min(ones):.3f}, "
              f"max {max(ones):.3f}) · {args.samples} samples, rerank {args.rerank} "
              f"{statistics.median(manys):.3f} s (min {min(manys):.3f}, max {max(manys):.3f})")
        print(f"       ratio of medians {statistics.median(manys) / statistics.median(ones):.2f}x"
              f" · per round {', '.join(f'{x:.2f}' for x in ratios)} (median "
              f"{statistics.median(ratios):.2f}x, max {max(ratios):.2f}x) · target < 3x")

if __name__ == "__main__":
    main()
