"""Batch generation speed: tokens/s for 64 prompts of mixed lengths at several
--batch-size values, through the same code path as `genlab generate --input`
(genlib.batch.jobs: grouping, per-line seeds, left-padded batched decode), on the backend
`auto` picks (the default).

    python benchmarks/bench_batch.py                      # stories260K, batch 1, 8, 32
    python benchmarks/bench_batch.py --model ../shared/models/code-target --rounds 3

The batch sizes run interleaved, round by round, and each figure is the median of the
rounds; ratios are against batch 1 in the same run (the machine is shared and noisy).
Every round also checks that each line's tokens are the same at every batch size.
Target from the issue: batch 32 >= 8x the tokens/s of batch 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260K"
WORDS = ("Once upon a time there was a little girl named Lily who loved to play in the park "
         "with her dog Max. One day they found a big red ball under a tree and the sun was "
         "shining so they ran and laughed all afternoon until mom called them home for "
         "dinner and a warm bath before bed").split()


def prompts(n: int, seed: int = 0) -> list[str]:
    """n JSONL lines with prompts from 2 to ~60 words, every length class mixed."""
    rng = random.Random(seed)
    return [json.dumps({"id": i, "prompt": " ".join(WORDS[:rng.randint(2, len(WORDS))])})
            for i in range(n)]


def measure(lm, lines: list[str], batch_size: int, settings: dict
            ) -> tuple[int, float, dict[int, tuple[int, ...]]]:
    """(new tokens, seconds, each line's token ids) of one pass over `lines`."""
    from genlib.batch import jobs as gb

    run = gb.RunDefaults(preset_settings={}, flags=settings, seed=0)
    jobs = gb.parse_lines(lines, run)
    for job in jobs:
        gb.encode(lm, job, run)
    start = time.perf_counter()
    outcomes = list(gb.generate_jobs(lm, jobs, batch_size))
    seconds = time.perf_counter() - start
    tokens = {index: finish.token_ids for index, (_, finish) in enumerate(outcomes)}
    return sum(len(ids) for ids in tokens.values()), seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every line generates exactly --max-new-tokens")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; each figure is their median")
    args = parser.parse_args()

    import torch

    from genlib.backends.choose import Request, choose_backend
    from genlib.models.loading import ModelSpec, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(ModelSpec(args.model))
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    backend = choose_backend(lm, Request(rows=max(sizes)))
    lines = prompts(args.prompts)
    settings = {"max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos or None}
    settings = {k: v for k, v in settings.items() if v is not None}
    measure(lm, lines[:4], 4, settings)  # warm-up
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · model "
          f"{args.model} · backend {backend.name} · {args.prompts} prompts · max_new_tokens "
          f"{args.max_new_tokens}{' (ignore_eos)' if args.ignore_eos else ''} · greedy · "
          f"torch threads {torch.get_num_threads()} · {args.rounds} interleaved rounds")
    rates: dict[int, list[float]] = {size: [] for size in sizes}
    totals: dict[int, int] = {}
    reference = None
    identical = True
    for _ in range(args.rounds):
        for size in sizes:
            tokens, seconds, ids = measure(lm, lines, size, settings)
            rates[size].append(tokens / seconds)
            totals[size] = tokens
            reference = reference or ids
            identical = identical and ids == reference
    print(f"{'batch':>6} {'tokens':>8} {'tok/s':>9} {'vs batch 1':>11}")
    base = statistics.median(rates[sizes[0]])
    for size in sizes:
        rate = statistics.median(rates[size])
        print(f"{size:>6} {totals[size]:>8} {rate:>9.1f} {rate / base:>10.2f}x")
    print("each line's tokens at every batch size: "
          + ("identical" if identical else "DIFFERENT"))


if __name__ == "__main__":
    main()
