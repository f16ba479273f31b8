"""Start-up, peak memory and a long prompt's first token: genlab against llama.cpp on one
model, interleaved rounds, medians.

- start: `python -m cli generate -m MODEL "x" -n 1` end to end (wall time and peak RSS
  from /usr/bin/time), the weight cache warm (an untimed run first) and the page cache
  warm; and llama.cpp's load plus first token on its GGUF, in a process of its own
  (llama-cpp-python: Python's start and the import included, as in genlab's figure, and
  the load + first token alone, timed inside).
- prefill: the time to the first token of a random --prompt-len token prompt (default
  512), inside one process each: genlab's native kernel (`NativeStep.prefill_rows`, what
  the native backend's prefill runs), llama.cpp's `eval`, and with --lean-prefill the
  torch forward's prefill (`LeanLlama.prefill`: blocked matrix products through torch.mm,
  what a blocked product in the kernel could approach).

    python benchmarks/bench_start_memory.py --model /tmp/smol360 --gguf /tmp/smol360.gguf

Without llama-cpp-python (or without --gguf) only genlab's rows are measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LLAMA_START = """
import sys, time
start = time.perf_counter()
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]),
            n_threads_batch=int(sys.argv[2]), verbose=False)
llm.eval([1, 2])
print(time.perf_counter() - start)
"""

GENLAB_PREFILL = """
import random, sys, time
import torch
from genlib.models.loading import ModelSpec, load_model
lm = load_model(ModelSpec(sys.argv[1]), quick=True)
step = lm.lean.native_step()
length, rounds = int(sys.argv[2]), int(sys.argv[3])
ids = [random.Random(0).randrange(3, lm.lean.vocab) for _ in range(length)]
step.prefill_rows([ids[:8]], [lm.lean.new_cache(length)])  # pages touched once
for _ in range(rounds):
    cache = lm.lean.new_cache(length)
    start = time.perf_counter()
    step.prefill_rows([ids], [cache])
    print("native", time.perf_counter() - start, flush=True)
if sys.argv[4] == "1":  # the torch forward's prefill: blocked matrix products (torch.mm)
    tokens = torch.tensor([ids])
    lm.lean.prefill(tokens[:, :8], lm.lean.new_cache(length))
    for _ in range(rounds):
        cache = lm.lean.new_cache(length)
        start = time.perf_counter()
        lm.lean.prefill(tokens, cache)
        print("lean", time.perf_counter() - start, flush=True)
"""

LLAMA_PREFILL = """
import random, sys, time
from llama_cpp import Llama
length, rounds = int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=sys.argv[1], n_ctx=length + 8, n_batch=512, n_ubatch=512,
            n_threads=int(sys.argv[4]), n_threads_batch=int(sys.argv[4]), verbose=False)
ids = [random.Random(0).randrange(3, llm.n_vocab()) for _ in range(length)]
llm.eval(ids[:8])
for _ in range(rounds):
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    print("llama.cpp", time.perf_counter() - start, flush=True)
"""


def timed(command: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS in bytes (GNU time's %M), and stdout of one process."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "%M", *command], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    return wall, int(done.stderr.strip().splitlines()[-1]) * 1024, done.stdout


def weights_bytes(model: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model) / "model.safetensors"), "pt") as file:
        return sum(_numel(file.get_slice(name).get_shape()) * 4
                   for name in file.keys())  # noqa: SIM118


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def start_rounds(args: argparse.Namespace, llama: bool) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    genlab = [sys.executable, "-m", "cli", "generate", "-m", args.model, "x", "-n", "1"]
    llama_cmd = [sys.executable, "-c", LLAMA_START, str(args.gguf), str(args.threads)]
    timed(genlab, env)  # the weight cache written, the page cache warm
    if llama:
        timed(llama_cmd, env)
    rows: dict[str, list[tuple[float, int, float]]] = {"genlab": [], "llama.cpp": []}
    for _ in range(args.rounds):
        wall, peak, _ = timed(genlab, env)
        rows["genlab"].append((wall, peak, float("nan")))
        if llama:
            wall, peak, out = timed(llama_cmd, env)
            rows["llama.cpp"].append((wall, peak, float(out.strip().splitlines()[-1])))
    weights = weights_bytes(args.model)
    print(f"weights: {weights / 1e9:.2f} GB float32")
    for name, runs in rows.items():
        if runs:
            walls = sorted(r[0] for r in runs)
            inner = statistics.median(r[2] for r in runs)
            peak = statistics.median(r[1] for r in runs)
            print(f"{name}: process wall median {statistics.median(walls):.2f} s "
                  f"(range {walls[0]:.2f}-{walls[-1]:.2f}), peak RSS {peak / 1e9:.2f} GB "
                  f"({peak / weights:.2f}x the weights)"
                  + (f", load + first token inside {inner:.2f} s" if name != "genlab" else ""))


def prefill_rounds(args: argparse.Namespace, llama: bool) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    per = 3
    times: dict[str, list[float]] = {"native": [], "lean": [], "llama.cpp": []}
    lean = "1" if args.lean_prefill else "0"
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, "-c", GENLAB_PREFILL, args.model,
                              str(args.prompt_len), str(per), lean], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        if llama:
            out += subprocess.run([sys.executable, "-c", LLAMA_PREFILL, str(args.gguf),
                                   str(args.prompt_len), str(per), str(args.threads)],
                                  env=env, cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout
        for line in out.splitlines():
            name, seconds = line.split()
            times[name].append(float(seconds))
    for name, runs in times.items():
        if runs:
            runs.sort()
            print(f"{name}: {args.prompt_len}-token prefill median {statistics.median(runs):.3f} s "
                  f"(range {runs[0]:.3f}-{runs[-1]:.3f}, {len(runs)} runs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--gguf", help="llama.cpp's float32 GGUF of the same model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--lean-prefill", action="store_true",
                        help="also time the torch forward's prefill (blocked products)")
    parser.add_argument("--skip", choices=("start", "prefill"), action="append", default=[])
    args = parser.parse_args()
    try:
        import llama_cpp  # noqa: F401
        llama = args.gguf is not None
    except ImportError:
        llama = False
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"{args.threads} threads, llama.cpp {'measured' if llama else 'not measured'}")
    if "start" not in args.skip:
        start_rounds(args, llama)
    if "prefill" not in args.skip:
        prefill_rounds(args, llama)


if __name__ == "__main__":
    main()
