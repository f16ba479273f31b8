"""`genlab generate` end to end (start, load, 50 tokens, exit), docs/performance.md's
figures: wall time of the real command with the quick start and with GENLAB_LEAN=0
(transformers' Auto classes), then where the time goes inside one process.

    python benchmarks/bench_startup.py [--runs 5] [--model ../shared/models/stories260K]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

PHASES = """
import sys, time
start = time.perf_counter()
import torch
t_torch = time.perf_counter()
import cli.generate, cli.main
t_cli = time.perf_counter()
from genlib.settings.config import resolve_settings
from genlib.generate import generate
from genlib.models.loading import ModelSpec, load_model
lm = load_model(ModelSpec(sys.argv[1]), quick=True)
t_load = time.perf_counter()
generate(lm, [lm.encode("Once upon a time")], resolve_settings({"max_new_tokens": 50}))
t_tokens = time.perf_counter()
print(f"import torch {t_torch - start:.2f} s, genlab's CLI {t_cli - t_torch:.2f} s, "
      f"load {t_load - t_cli:.2f} s (quick start: {lm.lean is not None}), "
      f"50 tokens {t_tokens - t_load:.2f} s")
"""


def wall(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", default="../shared/models/stories260K")
    args = parser.parse_args()
    command = ["genlab", "generate", "-m", args.model, "-n", "50", "Once upon a time"]
    for label, extra in (("quick start", {}), ("GENLAB_LEAN=0", {"GENLAB_LEAN": "0"})):
        times = [wall(command, {**os.environ, **extra}) for _ in range(args.runs)]
        print(f"{label:14s} " + " ".join(f"{t:.2f}" for t in times) + " s")
    subprocess.run([sys.executable, "-c", PHASES, args.model], check=True)


if __name__ == "__main__":
    main()
