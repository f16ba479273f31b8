"""What a token of an ensemble or of contrastive decoding costs against the two models'
own steps: per pair of models, greedy decoding of model A alone, model B alone, their
mean ensemble and contrastive decoding (A the expert, B the amateur), interleaved
round by round, on the backend auto picks (the native kernel for float32 Llama-style
models on a CPU).

    python benchmarks/bench_ensemble.py [--tokens 128] [--rounds 7] [--threads 1]

A run's per-token time is its decode time after the first token (Finish.end -
Finish.first_token) over the tokens after the first; end tokens are ignored so every
run makes exactly --tokens tokens. Reported per pair: each run's median per-token time,
and the combined runs' ratio to A + B, the median of the per-round ratios (each round
times all four back to back, so a busy spell moves numerator and denominator alike)
with their min-max spread.

`--controls` adds two mean ensembles of A with itself, each against 2 x A: with the same
loaded model twice (the combination's own cost: one set of weights in the caches), and
with a second copy of A's files (the same arithmetic over a second copy of the weights
in memory). Where the copy costs more than the model twice, the difference is the
second set of weights not fitting in the core's caches beside the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT.parent / "shared" / "models"
PAIRS = {"code": ("code-target", "code-draft", "import os\nimport sys\n\n\ndef main(argv):\n"),
         "stories": ("stories260K", "llama2xs", "Once upon a time")}


def per_token(lm, ids: list[int], settings) -> tuple[float, str]:
    """Seconds per token after the first, and the backend that ran."""
    from genlib.events import Finish, Prefill
    from genlib.generate import stream

    backend, finish = "", None
    for event in stream(lm, [ids], settings):
        if isinstance(event, Prefill):
            backend = event.backend
        elif isinstance(event, Finish):
            finish = event
    assert finish is not None and finish.first_token is not None
    return (finish.end - finish.first_token) / (len(finish.token_ids) - 1), backend


def bench_pair(name: str, tokens: int, rounds: int, copy: Path | None) -> dict[str, object]:
    from genlib.models.loading import ModelSpec, load_model
    from genlib.sampling.combine import AMATEUR, ENSEMBLE, Partner
    from genlib.settings.config import GenerationSettings

    first, second, prompt = PAIRS[name]
    a = load_model(ModelSpec(str(MODELS / first)), quick=True)
    b = load_model(ModelSpec(str(MODELS / second)), quick=True)
    ids = a.encode(prompt)
    plain = GenerationSettings(max_new_tokens=tokens, ignore_eos=True)
    mean = dataclasses.replace(plain, ensemble_mode="mean")
    runs = {"A": (a, plain), "B": (b, plain),
            "ensemble": (dataclasses.replace(a, partners=(Partner(b, ENSEMBLE),)), mean),
            "cd": (dataclasses.replace(a, partners=(Partner(b, AMATEUR),)),
                   dataclasses.replace(plain, cd_beta=0.5))}
    if copy is not None:
        shutil.copytree(MODELS / first, copy / first)
        a_copy = load_model(ModelSpec(str(copy / first)), quick=True)
        runs["A+A"] = (dataclasses.replace(a, partners=(Partner(a, ENSEMBLE),)), mean)
        runs["A+copy"] = (dataclasses.replace(a, partners=(Partner(a_copy, ENSEMBLE),)), mean)
    for lm, settings in runs.values():  # warm-up: kernel builds, packed weights, caches
        per_token(lm, ids, dataclasses.replace(settings, max_new_tokens=8))
    times: dict[str, list[float]] = {key: [] for key in runs}
    backends: dict[str, str] = {}
    for _ in range(rounds):
        for key, (lm, settings) in runs.items():
            seconds, backends[key] = per_token(lm, ids, settings)
            times[key].append(seconds)
    out: dict[str, object] = {"pair": f"{first} + {second}", "backends": backends}
    for key, values in times.items():
        out[f"{key}_ms"] = statistics.median(values) * 1e3
    for key in runs.keys() - {"A", "B"}:
        second_model = times["A"] if key.startswith("A+") else times["B"]
        ratios = [t / (x + y) for t, x, y in zip(times[key], times["A"], second_model)]
        out[f"{key}_ratio"] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", default="code,stories")
    parser.add_argument("--controls", action="store_true",
                        help="also time A with itself, and with a copy of its files")
    args = parser.parse_args()
    import torch

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(args.threads)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · {platform.node()} · "
          f"{platform.processor() or platform.machine()} · torch threads {args.threads} · "
          f"{args.tokens} tokens · {args.rounds} rounds")
    for name in args.pairs.split(","):
        with tempfile.TemporaryDirectory() as scratch:
            r = bench_pair(name, args.tokens, args.rounds,
                           Path(scratch) if args.controls else None)
        print(f"\n{r['pair']} (backends: {r['backends']})")
        print(f"  A alone {r['A_ms']:.3f} ms/token, B alone {r['B_ms']:.3f} ms/token, "
              f"A + B {r['A_ms'] + r['B_ms']:.3f}")  # type: ignore[operator]
        for key in ("ensemble", "cd", "A+A", "A+copy"):
            if f"{key}_ratio" not in r:
                continue
            median, low, high = r[f"{key}_ratio"]  # type: ignore[misc]
            against = "2 x A" if key.startswith("A+") else "A + B"
            print(f"  {key:8s} {r[f'{key}_ms']:.3f} ms/token = {median:.3f}x ({against}), "
                  f"rounds {low:.3f}-{high:.3f}")


if __name__ == "__main__":
    main()
