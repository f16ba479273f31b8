"""Beam search's speed in this checkout against an earlier revision's, interleaved:
`genlib.decoding.beam.beam_search` timed in-process (a fresh process per checkout and
round, each the median of --runs searches after one untimed), the checkouts
alternating round by round, so a busy machine slows both alike. `genlab bench` measures
the plain decode loop only; this is its counterpart for beam search. Prints each
round's figures, the medians, their ratio, and whether both gave the same tokens.

    git worktree add /tmp/before ca1e851
    python benchmarks/bench_beam_vs_revision.py /tmp/before --model ../shared/models/code-target

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

TIMED = """
import json, statistics, sys, time
import torch
from genlib.backends.combined import for_generation
from genlib.decoding import beam
from genlib.models.info import ModelSpec
from genlib.models.loading import load_model
from genlib.settings.config import GenerationSettings

model, backend, runs, threads, beams, new = sys.argv[1:7]
torch.set_num_threads(int(threads))
lm = load_model(ModelSpec(model))
ids = [lm.encode("def fibonacci(n):")]
settings = GenerationSettings(strategy="beam", num_beams=int(beams),
                              max_new_tokens=int(new), num_return_sequences=1)
chosen = for_generation(lm, ids, settings, beam.backend_request(ids, settings, backend))
beam.beam_search(lm, ids, settings, backend=chosen)  # untimed
times = []
for _ in range(int(runs)):
    start = time.perf_counter()
    result = beam.beam_search(lm, ids, settings, backend=chosen)
    times.append(time.perf_counter() - start)
print(json.dumps({"seconds": statistics.median(times), "backend": chosen.name,
                  "tokens": list(result[0].hypotheses[0].token_ids)}))
"""


def timed(checkout: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", TIMED, str(Path(args.model).resolve()),
                           args.backend, str(args.runs), str(args.threads),
                           str(args.beams), str(args.new_tokens)],
                          cwd=checkout, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="a checkout of the earlier revision")
    parser.add_argument("--model", default="../shared/models/code-target")
    parser.add_argument("--backend", default="native")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    seen: dict[str, list[dict]] = {"now": [], "before": []}
    for number in range(args.rounds):
        for side, checkout in (("before", args.before.resolve()), ("now", HERE)):
            record = timed(checkout, args)
            seen[side].append(record)
            print(f"round {number + 1} {side:6s} {record['seconds']:.4f} s "
                  f"({record['backend']})", flush=True)
    now, before = (statistics.median(r["seconds"] for r in seen[s]) for s in ("now", "before"))
    same = all(r["tokens"] == seen["now"][0]["tokens"] for s in seen for r in seen[s])
    print(f"model {args.model}, {args.beams} beams, {args.new_tokens} new tokens, "
          f"--backend {args.backend}, {args.threads} threads; medians of {args.rounds} "
          f"rounds of {args.runs} searches")
    print(f"  before {before:.4f} s, now {now:.4f} s: now / before x{before / now:.3f} "
          f"speed; same tokens in every run: {same}")


if __name__ == "__main__":
    main()
