"""Time bench's prompt builder (`genlib.bench.exact_prompts`, a window of the filler text
per row) against the tail-slicing it replaced (`(head + text_ids[i:])[:length]`, which
copies the whole rest of the text for every row: quadratic in the batch size).

    python benchmarks/bench_prompts.py --rows 10000,40000 --length 128 --repeats 3

Runs alternate (window, tail, window, tail, ...) and the medians are printed."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from genlib import bench
from genlib.models import ModelSpec, load_model

MODEL = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "stories260K"


def tail_prompts(lm, length: int, batch_size: int) -> list[list[int]]:
    body = lm.encode(bench.FILLER)
    head = [body[0]] if body[0] == lm.tokenizer.bos_token_id else []
    text = body[len(head):]
    need = length - len(head) + batch_size
    text_ids = (text * (need // len(text) + 1))[:need]
    return [(head + text_ids[i:])[:length] for i in range(batch_size)]


def timed(build, lm, length: int, rows: int) -> float:
    start = time.perf_counter()
    build(lm, length, rows)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--rows", default="10000,40000")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lm = load_model(ModelSpec(ref=args.model), quick=True)
    for rows in (int(r) for r in args.rows.split(",")):
        window, tail = [], []
        for _ in range(args.repeats):
            window.append(timed(bench.exact_prompts, lm, args.length, rows))
            tail.append(timed(tail_prompts, lm, args.length, rows))
        print(f"rows {rows:>7,}  window {statistics.median(window):8.3f} s "
              f"({min(window):.3f}-{max(window):.3f})  tail {statistics.median(tail):8.3f} s "
              f"({min(tail):.3f}-{max(tail):.3f})")


if __name__ == "__main__":
    main()
