"""Per-token cost of contrastive search and DoLa against plain greedy search, on one
model, interleaved: each round runs every strategy once, in turn, so a busy machine
slows them alike. Prints each strategy's median decode time per token over the rounds
(the time after the first token, over the tokens after it), its range, the ratio of
the medians to greedy's on the same backend (lean, the one these strategies run on),
and the median and range of each round's ratio (runs seconds apart).

    python benchmarks/bench_contrastive.py --model ../shared/models/code-target \\
        --steps 64 --rounds 7

End tokens are ignored (ignore_eos), so every run decodes --steps tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRATEGIES = {  # label -> (settings, backend)
    "greedy (native)": ({}, "auto"),
    "greedy (lean)": ({}, "lean"),
    "contrastive a=0.6 k=4": ({"penalty_alpha": 0.6, "top_k": 4}, "auto"),
    "contrastive a=0.6 k=8": ({"penalty_alpha": 0.6, "top_k": 8}, "auto"),
    "dola high": ({"dola_layers": "high", "repetition_penalty": 1.2}, "auto"),
    "greedy rp=1.2 (lean)": ({"repetition_penalty": 1.2}, "lean"),
}


def per_token(lm, ids: list[int], settings, backend: str) -> tuple[float, str]:
    """One run: seconds per token after the first, and the backend that ran."""
    from genlib.events import Finish, Prefill
    from genlib.generate import stream

    name, finish = "", None
    for event in stream(lm, [ids], settings, backend=backend):
        if isinstance(event, Prefill):
            name = event.backend
        elif isinstance(event, Finish):
            finish = event
    assert finish is not None and finish.first_token is not None
    return (finish.end - finish.first_token) / (len(finish.token_ids) - 1), name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT.parent / "shared/models/stories260K"))
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    from genlib.models.loading import ModelSpec, load_model
    from genlib.settings.config import resolve_settings

    lm = load_model(ModelSpec(args.model, device="cpu"))
    ids = lm.encode(args.prompt)
    plans = {label: (resolve_settings({"max_new_tokens": args.steps, "ignore_eos": True,
                                       **extra}), backend)
             for label, (extra, backend) in STRATEGIES.items()}
    times: dict[str, list[float]] = {label: [] for label in plans}
    ran: dict[str, str] = {}
    for settings, backend in plans.values():  # warm-up, untimed
        per_token(lm, ids, settings, backend)
    for _ in range(args.rounds):
        for label, (settings, backend) in plans.items():
            seconds, ran[label] = per_token(lm, ids, settings, backend)
            times[label].append(seconds)
    base = times["greedy (lean)"]
    print(f"model {args.model}, prompt {args.prompt!r}, {args.steps} tokens, "
          f"{args.rounds} rounds, {args.threads} threads")
    print(f"{'strategy':<24} {'backend':<8} {'ms/token':>9} {'range':>15} "
          f"{'x greedy lean':>14} {'per round':>16}")
    for label, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}"
        rounds = [v / b for v, b in zip(values, base)]
        per_round = f"{statistics.median(rounds):.2f} ({min(rounds):.2f}-{max(rounds):.2f})"
        print(f"{label:<24} {ran[label]:<8} {median * 1e3:>9.2f} {spread:>15} "
              f"{median / statistics.median(base):>14.2f} {per_round:>16}")

if __name__ == "__main__":
    main()
