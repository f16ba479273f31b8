"""Speculative decoding speed, in one run: plain greedy vs draft-model speculation vs
prompt-lookup speculation, with acceptance and the speed-up Leviathan et al.'s formula
predicts from the measured acceptance and draft/target cost ratio.

    python benchmarks/bench_speculative.py [--repeats 3] [--max-new-tokens 200] [--json]
    python benchmarks/bench_speculative.py --num-draft-tokens 2,3,4,5,6   # gammas, interleaved

Pairs: ../shared/models/code-target + code-draft (the realistic speed case, when present)
and stories260K + llama2xs (same size: shows acceptance, not speed). Every figure is a
median over --repeats rounds after one warm-up, all in this process, and each round
runs every mode of a prompt once, so a faster or slower spell of a noisy shared machine
reaches them alike. Decode speed = new tokens / (finish - end of prefill), the same
clock for every mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = ROOT.parent / "shared" / "models"

CODE_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
CODE_FUNCTION = (
    "def merge_sorted(left, right):\n"
    "    result = []\n"
    "    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            result.append(left[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            result.append(right[j])\n"
    "            j += 1\n"
    "    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n"
    "    return result\n"
)
# Extractive: the answer is text already in the context (a copy of the function).
CODE_EXTRACTIVE = (f"{CODE_FUNCTION}\n\n# The same function again, unchanged:\n\n"
                   f"def merge_sorted(left, right):\n")
STORY_PROMPT = "Once upon a time"
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
         "in the park. One day, she saw a big, red ball.")
STORY_EXTRACTIVE = f"{STORY} {STORY} {STORY[:40]}"


@dataclass
class Case:
    pair: str
    target: str
    draft: str
    prompt: str
    extractive: str
    max_new_tokens: int


def cases(max_new: int) -> list[Case]:
    out = []
    if (MODELS / "code-target").is_dir() and (MODELS / "code-draft").is_dir():
        out.append(Case("code", "code-target", "code-draft", CODE_PROMPT, CODE_EXTRACTIVE,
                        max_new))
    # llama2xs has 256 positions: prompt + new tokens must fit.
    out.append(Case("stories", "stories260K", "llama2xs", STORY_PROMPT, STORY_EXTRACTIVE,
                    min(max_new, 150)))
    return out


def decode_rate(events: list[Any]) -> tuple[float, tuple[int, ...]]:
    from genlib.events import Finish, Prefill

    prefill = next(e for e in events if isinstance(e, Prefill))
    finish = next(e for e in events if isinstance(e, Finish))
    seconds = finish.end - prefill.time
    return finish.new_tokens / seconds, finish.token_ids


def measure(runs: dict[str, Callable[[], Any]], repeats: int
            ) -> dict[str, tuple[float, list[Any]]]:
    """Each mode warmed up once, then `repeats` rounds that run every mode once, so a
    spell of a faster or slower machine reaches every mode alike: per mode, the median
    decode tokens/s and the last round's events."""
    for run in runs.values():
        list(run())
    rates: dict[str, list[float]] = {mode: [] for mode in runs}
    events: dict[str, list[Any]] = {}
    for _ in range(repeats):
        for mode, run in runs.items():
            events[mode] = list(run())
            rates[mode].append(decode_rate(events[mode])[0])
    return {mode: (statistics.median(rates[mode]), events[mode]) for mode in runs}


def bench_case(case: Case, repeats: int, gammas: list[int], lookup_gamma: int, ngram: int
               ) -> list[dict[str, Any]]:
    from genlib.config import resolve_settings
    from genlib.generate import stream
    from genlib.models import ModelSpec, load_model
    from genlib.speculative import speculative_stream, summarize

    target = load_model(ModelSpec(str(MODELS / case.target), device="cpu"))
    draft = load_model(ModelSpec(str(MODELS / case.draft), device="cpu"))
    settings = resolve_settings({"max_new_tokens": case.max_new_tokens, "ignore_eos": True})
    rows = []
    for prompt_name, prompt in (("open", case.prompt), ("extractive", case.extractive)):
        ids = target.encode(prompt)
        modes: dict[str, dict[str, Any]] = {"plain greedy": {}}
        if prompt_name == "open":
            for gamma in gammas:
                mode = "draft model" + (f" (gamma {gamma})" if len(gammas) > 1 else "")
                modes[mode] = {"draft_lm": draft, "num_draft_tokens": gamma}
        modes["prompt lookup"] = {"prompt_lookup": ngram, "num_draft_tokens": lookup_gamma}
        measured = measure({mode: lambda ids=ids, kw=kw: (
            speculative_stream(target, ids, settings, **kw) if kw
            else stream(target, [ids], settings)) for mode, kw in modes.items()}, repeats)
        plain_tps, plain_events = measured["plain greedy"]
        plain_ids = decode_rate(plain_events)[1]
        for mode, (tps, events) in measured.items():
            plain = mode == "plain greedy"
            same = decode_rate(events)[1] == plain_ids
            rows.append(_row(case, prompt_name, mode, tps, plain_tps,
                             None if plain else summarize(events), same))
    return rows


def _row(case: Case, prompt: str, mode: str, tps: float, plain_tps: float, summary: Any,
         identical: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"pair": case.pair, "target": case.target, "prompt": prompt,
                           "mode": mode, "tokens_per_s": round(tps, 1),
                           "speedup": round(tps / plain_tps, 3), "identical": identical}
    if summary is not None:
        predicted = summary.predicted_speedup()
        verify_cost = summary.verify_cost(plain_tps)
        costed = summary.predicted_speedup(verify_cost)
        row.update({"acceptance": round(summary.acceptance_rate, 3),
                    "alpha": round(summary.alpha, 3),
                    "tokens_per_forward": round(summary.tokens_per_forward, 2),
                    "cost_ratio": round(summary.cost_ratio, 3),
                    "verify_cost": round(verify_cost, 2),
                    "predicted": round(predicted, 3),
                    "measured_over_predicted": round(tps / plain_tps / predicted, 3),
                    "predicted_with_verify_cost": round(costed, 3),
                    "measured_over_costed": round(tps / plain_tps / costed, 3)})
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| pair | prompt | mode | tok/s | speed-up | acceptance | alpha | tokens/fwd | c "
            "| verify cost | predicted | measured/predicted | predicted with verify cost "
            "| measured/that | same tokens |")
    lines = [head, "|" + " --- |" * 15]
    for r in rows:
        get = r.get
        lines.append(
            f"| {r['pair']} | {r['prompt']} | {r['mode']} | {r['tokens_per_s']} | "
            f"{r['speedup']:.2f}x | {_pct(get('acceptance'))} | {get('alpha', '-')} | "
            f"{get('tokens_per_forward', '-')} | {get('cost_ratio', '-')} | "
            f"{get('verify_cost', '-')} | "
            f"{_x(get('predicted'))} | {get('measured_over_predicted', '-')} | "
            f"{_x(get('predicted_with_verify_cost'))} | {get('measured_over_costed', '-')} | "
            f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--num-draft-tokens", default="5",
                        help="the draft model's gamma, or a comma list measured interleaved")
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    gammas = [int(g) for g in args.num_draft_tokens.split(",")]
    rows = []
    for case in cases(args.max_new_tokens):
        rows.extend(bench_case(case, args.repeats, gammas, args.lookup_tokens, args.ngram))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"torch threads: {torch.get_num_threads()}, greedy, ignore_eos, "
              f"gamma {args.num_draft_tokens} (lookup {args.lookup_tokens}, n-gram "
              f"{args.ngram}), median of {args.repeats} interleaved rounds after a warm-up\n")
        print(markdown(rows))


if __name__ == "__main__":
    main()
