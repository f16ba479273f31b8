"""`sampling.draw` at 8,192 weights: this checkout's against an earlier file of it,
interleaved rounds, medians.

    git show f2e6eac^:genlib/sampling.py > old_sampling.py
    python benchmarks/results/2026-11-25-draft-costs/draw_timing.py old_sampling.py
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import timeit

import torch

from genlib import sampling

spec = importlib.util.spec_from_file_location("old_sampling", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
p, g = torch.rand(8192), torch.Generator().manual_seed(0)
times: dict[str, list[float]] = {"before": [], "after": []}
for r in range(7):
    pairs = [("before", old), ("after", sampling)]
    for name, module in pairs if r % 2 == 0 else pairs[::-1]:
        best = min(timeit.repeat(lambda m=module: m.draw(p, g), number=2000, repeat=3))
        times[name].append(best / 2000 * 1e6)
for name, values in times.items():
    print(f"{name}: median {statistics.median(values):.1f} us a draw "
          f"(rounds {', '.join(f'{v:.1f}' for v in values)})")
