"""The quality each quantized format keeps (genlib.lab.fidelity): a held-out text through
the float32 model and through each format on the native kernel, in windows of
--window tokens; perplexity, top-1 agreement with float32 and the mean KL divergence
from float32's next-token distributions, one row a format.

    python benchmarks/fidelity.py --model ../shared/models/code-target \\
        --text "$(python -c 'import rich.console as m; print(m.__file__)')"

With --gguf FILE (repeatable; llama-cpp-python installed) each GGUF's logits of every
position (`logits_all=True`) on the same token ids and windows are scored beside genlab's
formats, against genlab's float32: perplexity, top-1 agreement and mean KL. A last table
gives each GGUF's perplexity against each genlab format's as a paired difference, with
its standard error over the windows (a 0.02% gap on 12,566 positions is within noise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def llama_cpp_scorer(gguf: str, width: int, threads: int):
    """A window's next-token log-probabilities under llama.cpp, each from a fresh context."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=width, n_threads=threads, n_threads_batch=threads,
                n_batch=width, logits_all=True, verbose=False)

    def score(piece: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(piece[:-1])
        logits = torch.from_numpy(np.array(llm.scores[:len(piece) - 1], dtype=np.float64))
        return torch.log_softmax(logits, dim=-1)

    return score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", required=True, help="a held-out text file")
    parser.add_argument("--formats", default="q8_0,nf4,q4_0")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", action="append", default=[])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    import torch

    from genlib.backends.lean import lean_model_of
    from genlib.lab.fidelity import native_scorers, tally, windows
    from genlib.models.loading import ModelSpec, load_model

    torch.set_num_threads(args.threads)
    lm = load_model(ModelSpec(args.model), quick=True)
    tokens = lm.encode(Path(args.text).read_text(encoding="utf-8"))
    pieces = windows(tokens, args.window)
    scorers = native_scorers(lean_model_of(lm), args.formats.split(","), args.threads)
    for gguf in args.gguf:
        scorers[f"llama.cpp {Path(gguf).name}"] = llama_cpp_scorer(
            gguf, max(len(p) for p in pieces), args.threads)
    tallies = tally(pieces, scorers)
    rows = [t.figures(name, tallies["float32"]).to_dict() for name, t in tallies.items()]
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"{now:%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{args.model}, {args.text}: {len(tokens)} tokens, windows of {args.window}")
    print(f"python benchmarks/fidelity.py {' '.join(sys.argv[1:])}\n")
    print("| weights | perplexity | vs float32 (standard error) | top-1 agreement "
          "| mean KL (nats) |")
    print("| --- | --- | --- | --- | --- |")
    base = rows[0]["perplexity"]
    for r in rows:
        error = "-" if r["perplexity_error"] is None else f"{r['perplexity_error']:.3%}"
        print(f"| {r['weights']} | {r['perplexity']:.3f} | {r['perplexity'] / base - 1:+.3%} "
              f"({error}) | {r['top1_agreement']:.2%} | {r['mean_kl']:.5f} |")
    ggufs = [name for name in tallies if name.startswith("llama.cpp")]
    ours = [name for name in tallies if name != "float32" and name not in ggufs]
    if ggufs:
        print("\n| genlab | llama.cpp | perplexity, genlab's against llama.cpp's "
              "| standard error |")
        print("| --- | --- | --- | --- |")
    for theirs in ggufs:
        for name in ours:
            if len(pieces) < 2:
                continue  # no spread from one window
            gap, error = tallies[name].difference(tallies[theirs])
            print(f"| {name} | {theirs.split(' ', 1)[1]} | {math.expm1(gap):+.3%} "
                  f"| {error:.3%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
