"""A genlab command's whole run in this tree against an earlier checkout, interleaved: wall
time (Python's start, imports, load, the tokens, exit) and peak RSS of the process, each
tree's caches warm (an untimed run of each first), medians over the rounds.

    git worktree add /tmp/before REVISION
    python benchmarks/bench_start_vs_revision.py /tmp/before --model builtin:code-small \
        --model ../shared/models/stories260K --rounds 7
    python benchmarks/bench_start_vs_revision.py /tmp/before --model MODEL \
        --command "beam -k 4 -n 4"

The command (default `generate -n 1`) gets `-m MODEL` and the prompt "def f(". Each
round runs every model in both trees, alternating which tree goes first.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(tree: Path, model: str, command: list[str]) -> tuple[float, float]:
    """(Seconds, peak RSS in GB) of one `genlab COMMAND -m MODEL "def f("` run from
    `tree`."""
    began = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "cli", *command, "-m", model, "def f("],
                               cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - began
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} -m {model} failed in {tree} "
                         f"(exit {process.returncode})")
    return seconds, usage.ru_maxrss / 1e6  # kB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="a checkout of the earlier revision")
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--command", default="generate -n 1",
                        help="the genlab command and its flags, without -m and the prompt")
    args = parser.parse_args()
    command = shlex.split(args.command)
    models = [str(Path(m).resolve()) if Path(m).exists() else m for m in args.model]
    trees = {"before": args.before.resolve(), "after": ROOT}
    for model in models:
        for tree in trees.values():
            start(tree, model, command)  # warm: weight cache, tokenizer cache, page cache
    runs: dict[tuple[str, str], list[tuple[float, float]]] = \
        {(m, t): [] for m in models for t in trees}
    for round_ in range(args.rounds):
        for model in models:
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for name in order:
                runs[model, name].append(start(trees[name], model, command))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {platform.node()} · "
          f"{platform.processor() or platform.machine()} · genlab {args.command} · "
          f"{args.rounds} rounds")
    for model in models:
        before, after = runs[model, "before"], runs[model, "after"]
        ratios = [a[0] / b[0] for a, b in zip(after, before)]
        print(f"{model}: before {statistics.median(r[0] for r in before):.2f} s "
              f"{statistics.median(r[1] for r in before):.2f} GB, after "
              f"{statistics.median(r[0] for r in after):.2f} s "
              f"{statistics.median(r[1] for r in after):.2f} GB; time after/before "
              f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
