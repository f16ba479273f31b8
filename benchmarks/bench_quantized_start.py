"""Load to first token of a built-in model stored quantized (genlab's q8_0 and nf4
checkpoints, written by scripts/quantize_model.py into a scratch folder) against the
shipped bfloat16 one: `genlab generate -m MODEL "def f(" -n 1`'s wall and CPU time
(interpreter, imports, load, first token), and in a fresh process the time from the
load's start to the first token; the runs of the models interleaved, medians reported.
The first start of each quantized copy packs its codes into the weight cache (reported
apart); later starts map them.

    python benchmarks/bench_quantized_start.py [--runs 9] [--model builtin:code-small]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("q8_0", "nf4")


# In a fresh process, after the imports: the CLI's load (quick start, the native
# kernel's weights packed or mapped from the cache) and the first token, as
# `genlab generate` runs them.
IN_PROCESS = """
import sys, time
import torch, cli.generate
from cli.context import ModelFlags, load
from genlib.settings.config import resolve_settings
from genlib.generate import generate
start = time.perf_counter()
lm = load(ModelFlags(sys.argv[1]), quick=True)
loaded = time.perf_counter()
generate(lm, [lm.encode("def f(")], resolve_settings({"max_new_tokens": 1}))
print(loaded - start, time.perf_counter() - start)
"""


def run(model: str) -> tuple[float, float, float]:
    """One `generate -m MODEL "def f(" -n 1`: its wall and CPU seconds, start to exit; and
    in another process, the seconds from the load's start to the first token."""
    command = [sys.executable, "-m", "cli", "generate", "-m", model, "def f(", "-n", "1"]
    before = os.times()
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + \
        (after.children_system - before.children_system)
    done = subprocess.run([sys.executable, "-c", IN_PROCESS, model], cwd=ROOT, check=True,
                          capture_output=True, text=True)
    return wall, cpu, float(done.stdout.split()[-1])


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--model", default="builtin:code-small")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from genlib.models.loading import model_source

    source = Path(model_source(args.model))
    with tempfile.TemporaryDirectory() as scratch:
        models = {args.model: source}
        for fmt in FORMATS:
            out = Path(scratch) / f"{source.name}-{fmt}"
            subprocess.run([sys.executable, "scripts/quantize_model.py", str(source),
                            str(out), "--format", fmt], cwd=ROOT, check=True)
            models[fmt] = out
        first = {name: run(str(path)) for name, path in models.items()}
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in models}
        for _ in range(args.runs):  # interleaved: the machine's load falls on each alike
            for name, path in models.items():
                times[name].append(run(str(path)))
        print("model, MB on disk, then seconds: first start (wall, cpu, load to first "
              "token); later starts' median [min-max] of each")
        for name, path in models.items():
            columns = [sorted(values) for values in zip(*times[name])]
            spread = "  ".join(f"{statistics.median(c):.2f} [{c[0]:.2f}-{c[-1]:.2f}]"
                               for c in columns)
            print(f"{name:20s} {folder_bytes(path) / 1e6:5.2f}  first "
                  f"{' '.join(f'{t:.2f}' for t in first[name])}  later {spread}")


if __name__ == "__main__":
    main()
