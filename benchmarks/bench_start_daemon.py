"""Start, load and first token: `genlab generate -m MODEL "x" -n 1` in a process of its
own, the same command served by a start daemon (`genlab daemon start`), and llama.cpp's
load plus first token on its GGUF of the same format, in a process of its own
(llama-cpp-python: the interpreter's start and the import included). Interleaved rounds,
medians, each engine's warm-up run untimed (the weight cache written, the page cache
warm: the issue's "second start").

    python benchmarks/bench_start_daemon.py --model /tmp/smol360 \\
        --format float32=/tmp/gguf/smol360-f32.gguf --format 8bit=/tmp/gguf/smol360-q8_0.gguf \\
        --format 4bit=/tmp/gguf/smol360-q4_0.gguf

A format is genlab's `--quantize` value (float32: none); its GGUF is optional (without
llama-cpp-python or a GGUF, only genlab's rows). The daemon runs in a socket folder of
the script's own and is stopped at the end. Python writes the checkout's bytecode on the
warm-up runs (PYTHONDONTWRITEBYTECODE is unset), as an install has it.
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

from bench_start_memory import LLAMA_START  # llama.cpp's load and first token, alone

ROOT = Path(__file__).resolve().parents[1]


def wall(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--format", action="append", default=[],
                        help="FORMAT[=GGUF]: float32, 8bit or 4bit, and llama.cpp's GGUF "
                             "of that format")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    formats = [f.split("=", 1) if "=" in f else (f, None) for f in args.format or ["float32"]]
    try:
        import llama_cpp  # noqa: F401
        llama = True
    except ImportError:
        llama = False
    runtime = tempfile.mkdtemp(prefix="genlab-bench-daemon-")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "XDG_RUNTIME_DIR": runtime,
           "GENLAB_DAEMON": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cold_env = {**env, "GENLAB_DAEMON": "0"}
    genlab = [sys.executable, "-m", "cli"]
    engines: dict[str, tuple[list[str], dict[str, str]]] = {}
    for name, gguf in formats:
        quantize = "none" if name == "float32" else name
        command = [*genlab, "generate", "-m", args.model, "x", "-n", "1", "--quantize",
                   quantize]
        engines[f"genlab {name}, a process of its own"] = (command, cold_env)
        engines[f"genlab {name}, served by the daemon"] = (command, env)
        if llama and gguf:
            engines[f"llama.cpp {Path(gguf).name}"] = (
                [sys.executable, "-c", LLAMA_START, gguf, str(args.threads)], env)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"{args.threads} threads, {args.rounds} rounds, model {args.model}")
    subprocess.run([*genlab, "daemon", "start"], env=env, cwd=ROOT, check=True)
    try:
        for command, engine_env in engines.values():
            wall(command, engine_env)  # warm-up: caches written, pages read
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, (command, engine_env) in engines.items():
                times[name].append(wall(command, engine_env))
    finally:
        subprocess.run([*genlab, "daemon", "stop"], env=env, cwd=ROOT)
    print("| engine | wall median (s) | range (s) | vs llama.cpp, same format |")
    print("| --- | --- | --- | --- |")
    for name, gguf in formats:
        base = statistics.median(times[f"llama.cpp {Path(gguf).name}"]) \
            if llama and gguf else None
        for engine, runs in times.items():
            if engine.startswith(f"genlab {name},") or (gguf and engine.endswith(
                    Path(gguf).name)):
                median = statistics.median(runs)
                ratio = f"{median / base:.2f}x" if base else "-"
                print(f"| {engine} | {median:.2f} | {min(runs):.2f}-{max(runs):.2f} | "
                      f"{ratio} |")


if __name__ == "__main__":
    main()
