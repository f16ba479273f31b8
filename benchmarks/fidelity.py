"""The quality each quantized format keeps (genlib.lab.fidelity): a held-out text through
the float32 model and through each format on the native kernel, in windows of
--window tokens; perplexity, top-1 agreement with float32 and the mean KL divergence
from float32's next-token distributions, one row a format.

    python benchmarks/fidelity.py --model ../shared/models/code-target \\
        --text "$(python -c 'import rich.console as m; print(m.__file__)')"

With --gguf FILE (repeatable; llama-cpp-python installed) each GGUF's perplexity on the
same token ids and windows is added (llama.cpp's logits of every position,
`logits_all=True`): its Q8_0 and Q4_0 files beside genlab's formats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def llama_cpp_perplexity(gguf: str, pieces: list[list[int]], threads: int) -> float:
    """exp(mean NLL) of each window's next tokens under llama.cpp, from a fresh context."""
    import numpy as np
    from llama_cpp import Llama

    width = max(len(p) for p in pieces)
    llm = Llama(model_path=gguf, n_ctx=width, n_threads=threads, n_threads_batch=threads,
                n_batch=width, logits_all=True, verbose=False)
    nll, count = 0.0, 0
    for piece in pieces:
        llm.reset()
        llm.eval(piece[:-1])
        logits = np.asarray(llm.scores[:len(piece) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        nll += float((logz - logits[np.arange(len(piece) - 1), piece[1:]]).sum())
        count += len(piece) - 1
    return float(np.exp(nll / count))


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
    from genlib.lab.fidelity import fidelity, windows
    from genlib.models.loading import ModelSpec, load_model

    torch.set_num_threads(args.threads)
    lm = load_model(ModelSpec(args.model), quick=True)
    tokens = lm.encode(Path(args.text).read_text(encoding="utf-8"))
    report = fidelity(lean_model_of(lm), tokens, args.formats.split(","), args.window,
                      args.threads)
    rows = [r.to_dict() for r in report.values()]
    pieces = windows(tokens, args.window)
    for gguf in args.gguf:
        rows.append({"weights": f"llama.cpp {Path(gguf).name}", "positions":
                     sum(len(p) - 1 for p in pieces),
                     "perplexity": llama_cpp_perplexity(gguf, pieces, args.threads),
                     "top1_agreement": None, "mean_kl": None})
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"{now:%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{args.model}, {args.text}: {len(tokens)} tokens, windows of {args.window}")
    print(f"python benchmarks/fidelity.py {' '.join(sys.argv[1:])}\n")
    print("| weights | perplexity | vs float32 | top-1 agreement | mean KL (nats) |")
    print("| --- | --- | --- | --- | --- |")
    base = rows[0]["perplexity"]
    for r in rows:
        agree = "-" if r["top1_agreement"] is None else f"{r['top1_agreement']:.2%}"
        kl = "-" if r["mean_kl"] is None else f"{r['mean_kl']:.5f}"
        print(f"| {r['weights']} | {r['perplexity']:.3f} | {r['perplexity'] / base - 1:+.2%} "
              f"| {agree} | {kl} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
