"""A start of `genlab generate -n 1` in this tree against an earlier checkout, interleaved:
wall time of the whole command (Python's start, imports, load, first token, exit), each
tree's caches warm (an untimed run of each first), medians over the rounds.

    git worktree add /tmp/before REVISION
    python benchmarks/bench_start_vs_revision.py /tmp/before --model builtin:code-small \
        --model ../shared/models/stories260K --rounds 7

Each round runs every model in both trees, alternating which tree goes first.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(tree: Path, model: str) -> float:
    """Seconds for one `genlab generate -m MODEL -n 1` run from `tree`."""
    command = [sys.executable, "-m", "cli", "generate", "-m", model, "-n", "1", "def f("]
    began = time.perf_counter()
    subprocess.run(command, cwd=tree, check=True, capture_output=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="a checkout of the earlier revision")
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    models = [str(Path(m).resolve()) if Path(m).exists() else m for m in args.model]
    trees = {"before": args.before.resolve(), "after": ROOT}
    for model in models:
        for tree in trees.values():
            start(tree, model)  # warm: weight cache, tokenizer cache, page cache
    times = {(m, t): [] for m in models for t in trees}
    for round_ in range(args.rounds):
        for model in models:
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for name in order:
                times[model, name].append(start(trees[name], model))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {platform.node()} · "
          f"{platform.processor() or platform.machine()} · {args.rounds} rounds")
    for model in models:
        before = statistics.median(times[model, "before"])
        after = statistics.median(times[model, "after"])
        ratios = [a / b for a, b in zip(times[model, "after"], times[model, "before"])]
        print(f"{model}: before {before:.2f} s, after {after:.2f} s, after/before "
              f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
