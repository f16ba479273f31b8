"""One-row products at batch 1, as the decode step runs them (the figures of
benchmarks/results/matvec.txt): torch.mm (MKL's one-column SGEMM), the lean forward's
split product (`genlib.backends.llama._mm`) and torch.compile's reduction
(`genlib.backends.llama._matvec`, the products of --backend compiled's step), over
code-target's weight shapes (69 MB in float32, more than the L3 cache, so the weights
stream from memory), and the read bandwidth `genlab bench` measures
(`genlib.lab.bench.read_bandwidth`).

    python benchmarks/bench_matvec.py [--threads 2] [--reps 30]
"""

from __future__ import annotations

import argparse
import time

import torch

from genlib.backends.llama import _matvec, _mm, _Proj
from genlib.lab.bench import read_bandwidth

# code-target: 8 layers of q/k/v (fused), o, gate/up (fused), down; the tied lm_head.
SHAPES = [(1152, 384), (384, 384), (2048, 384), (384, 1024)] * 8 + [(8192, 384)]


def seconds_per_pass(products, reps: int) -> float:
    products()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            products()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    projs = [_Proj.of(torch.randn(n, k).t()) for n, k in SHAPES]
    rows = {k: torch.randn(1, k) for k in {k for _, k in SHAPES}}
    total = sum(p.w.numel() * p.w.element_size() for p in projs)
    compiled = torch.compile(lambda: [_matvec(rows[p.w.shape[0]], p) for p in projs],
                             options={"cpp_wrapper": True})
    ways = {
        "torch.mm (one MKL thread)": lambda: [torch.mm(rows[p.w.shape[0]], p.w) for p in projs],
        "split product (lean, eager)": lambda: [_mm(rows[p.w.shape[0]], p) for p in projs],
        "torch.compile reduction": compiled,
    }
    print(f"{len(projs)} products, {total / 1e6:.1f} MB of float32 weights, "
          f"{torch.get_num_threads()} threads")
    with torch.inference_mode():
        for name, products in ways.items():
            seconds = seconds_per_pass(products, args.reps)
            print(f"{name:32s} {seconds * 1e3:6.2f} ms per pass  {total / seconds / 1e9:5.1f} GB/s")
    print(f"{'read bandwidth (genlab bench)':32s} {read_bandwidth() / 1e9:21.1f} GB/s")


if __name__ == "__main__":
    main()
