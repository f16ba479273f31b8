"""This checkout's backends against an earlier revision's paths, interleaved: genlab
bench on --backend native and lean here, and in the other checkout on the same backends
(a revision that has them) or on --compile and the default loop (the revision before the
backend interface), round by round, so a busy machine slows both alike. Prints each
figure's median over the rounds and the ratios: of those medians, and each round's
(their median and range), which pairs runs seconds apart.

    git worktree add /tmp/before c515d27
    python benchmarks/bench_vs_revision.py /tmp/before --model ../shared/models/code-target

Both run with this Python; the earlier checkout's code is put first on its path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
FIGURES = ("decode_tps", "e2e_s")


def bench(checkout: Path, model: str, flags: list[str], threads: int, dtype: str
          ) -> list[dict]:
    """One `genlab bench --json` run in `checkout`; its records."""
    command = [sys.executable, "-m", "cli", "bench", "-m", model, "--runs", "3",
               "--no-bandwidth", "--threads", str(threads), "--dtype", dtype, "--json",
               *flags]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)["results"]


def flags(checkout: Path, fast: str) -> list[str]:
    """The fast backend and lean where the checkout has backends, else --compile (which
    measures the default loop beside it)."""
    if (checkout / "genlib" / "backends").is_dir():
        return ["--backend", f"{fast},lean"]
    return ["--compile"]


def label(side: str, record: dict) -> str:
    """SIDE:BACKEND (native, compiled, lean), or before:compile, before:default."""
    if "backend" in record:
        return f"{side}:{record['backend']}"
    return f"{side}:compile" if record.get("compile") else f"{side}:default"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="a checkout of the earlier revision")
    parser.add_argument("--model", default="../shared/models/stories260K")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto",
                        help="bfloat16: the compiled backend against the earlier --compile")
    args = parser.parse_args()
    fast = "compiled" if args.dtype in ("bfloat16", "float16") else "native"
    model = str(Path(args.model).resolve())
    seen: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for side, checkout in (("now", HERE), ("before", args.before.resolve())):
            for record in bench(checkout, model, flags(checkout, fast), args.threads,
                                args.dtype):
                figures = seen.setdefault(label(side, record), {f: [] for f in FIGURES})
                for figure in FIGURES:
                    figures[figure].append(record[figure])
    medians = {name: {f: statistics.median(v) for f, v in figs.items()}
               for name, figs in seen.items()}
    print(f"model {args.model}, dtype {args.dtype}, {args.rounds} interleaved rounds of 3 "
          f"runs, {args.threads} threads; medians")
    for name, figs in sorted(medians.items()):
        print(f"  {name:16} decode {figs['decode_tps']:9.1f} tok/s   e2e {figs['e2e_s']:.3f} s")
    for now, before in ((f"now:{fast}", f"before:{fast}"), (f"now:{fast}", "before:compile"),
                        ("now:lean", "before:lean"), ("now:lean", "before:default")):
        if now in medians and before in medians:
            ratio = medians[now]["decode_tps"] / medians[before]["decode_tps"]
            paired = paired_ratios(seen[now]["decode_tps"], seen[before]["decode_tps"])
            print(f"  {now} / {before}: decode tok/s x{ratio:.3f}; per round "
                  f"x{statistics.median(paired):.3f} (x{min(paired):.3f}-x{max(paired):.3f})")


def paired_ratios(now: list[float], before: list[float]) -> list[float]:
    """Each round's figure now over its figure before: the two sides of a round ran
    seconds apart, so a spell of faster or slower memory reaches both, where the ratio
    of the overall medians can set one side's fast spell against the other's slow one."""
    return [a / b for a, b in zip(now, before, strict=True)]


if __name__ == "__main__":
    main()
