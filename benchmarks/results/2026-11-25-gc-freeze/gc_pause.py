"""How long a full garbage collection stops the process once a model has loaded, with
the heap loading made left to the collector and frozen (`genlib.models.freeze_heap`,
which the CLI runs after loading). A decode that a full collection falls into stops for
that long; Python starts one on its own when enough objects have survived younger ones.

    python benchmarks/results/2026-11-25-gc-freeze/gc_pause.py MODEL [--rounds 5]

Each round runs in a fresh process (a collection's cost depends on the heap, not on
what ran before): load as the CLI loads (`cli.context.load`, its freeze undone for
the unfrozen case, or kept), then time `gc.collect()`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

ONE = """
import gc, json, sys, time
sys.path.insert(0, {root!r})
from cli.context import ModelFlags, load
lm = load(ModelFlags({model!r}), quick={quick})
if not {frozen}:
    gc.unfreeze()
tracked = len(gc.get_objects())
begin = time.perf_counter()
gc.collect()
print(json.dumps({{"ms": (time.perf_counter() - begin) * 1e3, "tracked": tracked,
                  "frozen": gc.get_freeze_count()}}))
"""


def one(model: str, quick: bool, frozen: bool) -> dict:
    code = ONE.format(root=str(ROOT), model=model, quick=quick, frozen=frozen)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("| load | heap | objects the collector walks | full collection, ms (median, range) |")
    print("| --- | --- | --- | --- |")
    for quick in (True, False):
        seen: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):  # interleaved
            for frozen in (False, True):
                seen[frozen].append(one(args.model, quick, frozen))
        for frozen, runs in seen.items():
            ms = [r["ms"] for r in runs]
            print(f"| {'quick (no transformers)' if quick else 'transformers'} | "
                  f"{'frozen' if frozen else 'left to the collector'} | "
                  f"{statistics.median(r['tracked'] for r in runs):,.0f} | "
                  f"{statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) |")


if __name__ == "__main__":
    main()
