"""JSONL batch on Ray: the same lines through the local engine and through --engine ray
with 1 and 2 workers, interleaved round by round, on a Ray cluster started here once.

    python benchmarks/bench_ray.py                          # code-target, 48 lines
    python benchmarks/bench_ray.py --rounds 3 --out benchmarks/results/ray.md

Each run is timed whole, as a user waits for it: for Ray, workers starting and loading
the model, then generating; for the local engine, loading the model, then generating.
`first` is the time to the first result. Ray workers get 1 CPU and 1 torch thread each;
the local engine uses torch's default threads. Medians over rounds, and ratios against
1 worker within each round (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "code-target"
Run = tuple[int, float, float, dict]  # tokens, first result (s), total (s), texts by id
SNIPPETS = ["import os\n", "def main(argv):\n    ", "class Parser:\n    def __init__(self",
            "for line in open(path):\n    ", "if __name__ == '__main__':\n    ",
            "try:\n    import json\nexcept ImportError:\n    "]


def input_lines(n: int, max_new_tokens: int) -> list[str]:
    """n lines, every other one sampled; each generates exactly max_new_tokens."""
    out = []
    for i in range(n):
        line: dict[str, object] = {"id": i, "prompt": SNIPPETS[i % len(SNIPPETS)],
                                   "max_new_tokens": max_new_tokens, "ignore_eos": True}
        if i % 2:
            line["temperature"] = 0.8
        out.append(json.dumps(line))
    return out


def run_local(model: str, lines: list[str], batch_size: int, threads: int = 0) -> Run:
    import torch


    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _run_local(model, lines, batch_size)
    finally:
        torch.set_num_threads(before)


def _run_local(model: str, lines: list[str], batch_size: int) -> Run:
    from genlib.batch import jobs as gb
    from genlib.models.loading import ModelSpec, load_model

    start = time.perf_counter()
    run = gb.RunDefaults({}, {})
    lm = load_model(ModelSpec(model))
    jobs = gb.parse_lines(lines, run)
    for job in jobs:
        gb.encode(lm, job, run)
    return _drain(gb.generate_jobs(lm, jobs, batch_size), start)


def run_ray(model: str, lines: list[str], batch_size: int, workers: int) -> Run:
    from genlib.batch import jobs as gb
    from genlib.batch.ray_engine import WorkerPlan, run_on_ray
    from genlib.models.loading import ModelSpec

    start = time.perf_counter()
    run = gb.RunDefaults({}, {})
    plan = WorkerPlan(spec=ModelSpec(model), run=run, batch_size=batch_size)
    return _drain(run_on_ray(gb.parse_lines(lines, run), lines, plan, workers), start)


def _drain(outcomes, start: float) -> Run:
    tokens, first, texts = 0, None, {}
    for job, finish in outcomes:
        first = first or time.perf_counter() - start
        tokens += finish.new_tokens
        texts[job.id] = finish.text
    return tokens, first or 0.0, time.perf_counter() - start, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--lines", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-threads", type=int, default=0,
                        help="torch threads of the local engine (0: torch's default)")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()

    from genlib.batch.ray_cluster import private_cluster_env

    private_cluster_env()  # loopback only, no usage report, no token file left in ~/.ray
    import ray

    cpus = os.cpu_count() or 1
    started = time.perf_counter()
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    cluster_s = time.perf_counter() - started
    lines = input_lines(args.lines, args.max_new_tokens)
    local = f"local engine, {args.local_threads or 'default'} threads"
    configs = {local: lambda: run_local(args.model, lines, args.batch_size, args.local_threads),
               "ray, 1 worker": lambda: run_ray(args.model, lines, args.batch_size, 1),
               "ray, 2 workers": lambda: run_ray(args.model, lines, args.batch_size, 2)}
    results: dict[str, list[Run]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, fn in configs.items():
            results[name].append(fn())
            tokens, first, total, _ = results[name][-1]
            print(f"round {r + 1} {name}: {tokens} tokens, first {first:.1f} s, "
                  f"total {total:.1f} s", file=sys.stderr)
    ray.shutdown()
    print(table(results, args, cluster_s, cpus))
    if args.out:
        args.out.write_text(table(results, args, cluster_s, cpus) + "\n")


def table(results, args, cluster_s: float, cpus: int) -> str:
    base = results["ray, 1 worker"]
    texts = [run[3] for runs in results.values() for run in runs]
    same = all(t == texts[0] for t in texts)
    rows = ["| engine | tokens | first result (s) | total (s) | tok/s | vs 1 worker |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, runs in results.items():
        ratios = [b[2] / r[2] for r, b in zip(runs, base)]
        total = statistics.median(r[2] for r in runs)
        rows.append(f"| {name} | {runs[0][0]} | {statistics.median(r[1] for r in runs):.1f} "
                    f"| {total:.1f} | {runs[0][0] / total:,.0f} "
                    f"| {statistics.median(ratios):.2f}x |")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python", "benchmarks/bench_ray.py", *sys.argv[1:]])
    return "\n".join([
        f"{when}, {platform.machine()} Linux, {cpus} CPUs shared with other work "
        f"(noisy), model {Path(args.model).name}, {args.lines} lines x "
        f"{args.max_new_tokens} tokens, --batch-size {args.batch_size}, medians of "
        f"{args.rounds} interleaved rounds; the Ray cluster itself took {cluster_s:.1f} s "
        f"to start (once, not in the rows). Every run gave the same text for every id: "
        f"{'yes' if same else 'NO'}.", f"Command: `{command}`", "", *rows])


if __name__ == "__main__":
    main()
