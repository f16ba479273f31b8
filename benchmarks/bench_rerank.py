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


def timed(lm, ids: list[int], settings) -> tuple[float, str]:
    """Seconds from the call to the last event (prefill, decode, rerank), and the
    backend that ran."""
    from genlib.events import Prefill
    from genlib.generate import stream

    backend = ""
    start = time.perf_counter()
    for event in stream(lm, [ids], settings):
        if isinstance(event, Prefill):
            backend = event.backend
    return time.perf_counter() - start, backend


def main() -> None:
    from genlib.config import resolve_settings
    from genlib.models import ModelSpec, load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rerank", default="logprob", help="logprob or mbr")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    lm = load_model(ModelSpec(args.model), quick=True)
    ids = lm.encode(PROMPT)
    common = {"temperature": 1.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    one = resolve_settings(common)
    many = resolve_settings({**common, "samples": args.samples, "rerank": args.rerank})
    timed(lm, ids, one.replace(seed=0, max_new_tokens=4))  # the first forward, untimed
    ones, manys, ratios = [], [], []
    backend = ""
    for r in range(args.rounds):
        pair = [("one", one.replace(seed=r)), ("many", many.replace(seed=r))]
        seconds = {}
        for name, settings in pair if r % 2 == 0 else reversed(pair):
            seconds[name], backend = timed(lm, ids, settings)
        ones.append(seconds["one"])
        manys.append(seconds["many"])
        ratios.append(seconds["many"] / seconds["one"])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{now} · model {Path(args.model).name} · backend {backend} · {args.max_new_tokens} new "
          f"tokens a sample (ignore_eos) · temperature 1.0 · {args.rounds} interleaved "
          f"rounds")
    print(f"  1 sample                    median {statistics.median(ones):.3f} s  "
          f"(min {min(ones):.3f}, max {max(ones):.3f})")
    print(f"  {args.samples} samples, rerank {args.rerank:<8} median "
          f"{statistics.median(manys):.3f} s  (min {min(manys):.3f}, max {max(manys):.3f})")
    print(f"  ratio of medians {statistics.median(manys) / statistics.median(ones):.2f}x · "
          f"per-round ratios {', '.join(f'{x:.2f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f}x) · target < 3x")


if __name__ == "__main__":
    main()
