"""Speculative decoding speed, in one run: plain decoding vs draft-model speculation vs
prompt-lookup speculation vs both (lookup first, the draft model where it finds no
match), with acceptance and the speed-up Leviathan et al.'s formula
predicts from the measured acceptance and draft/target cost ratio.

    python benchmarks/bench_speculative.py [--repeats 3] [--max-new-tokens 200] [--json]
    python benchmarks/bench_speculative.py --num-draft-tokens 2,3,4,5,6   # gammas, interleaved
    python benchmarks/bench_speculative.py --pairs code --draft-weights float32,bfloat16
    python benchmarks/bench_speculative.py --pairs code --schedules fixed,adaptive \
        [--code-prompt TEXT] [--temperature 0.8 --seed 2]

Greedy by default (each mode's tokens checked against plain greedy's); --temperature
samples, where the modes draw their random numbers in different orders and only the
speed compares.

Pairs: ../shared/models/code-target + code-draft (the realistic speed case, when present)
and stories260K + llama2xs (same size: shows acceptance, not speed). Every figure is a
median over --repeats rounds after one warm-up, all in this process, and each round
runs every mode of a prompt once, so a faster or slower spell of a noisy shared machine
reaches them alike. Decode speed = new tokens / (finish - end of prefill), the same
clock for every mode.
"""

from __future__ import annotations

import argparse
import itertools
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


def cases(max_new: int, code_prompt: str = CODE_PROMPT) -> list[Case]:
    out = []
    if (MODELS / "code-target").is_dir() and (MODELS / "code-draft").is_dir():
        out.append(Case("code", "code-target", "code-draft", code_prompt, CODE_EXTRACTIVE,
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


SCHEDULES = {"default": None, "fixed": False, "adaptive": True}  # speculative_stream's adaptive


def draft_modes(draft: Any, gammas: list[int], schedules: list[str], weights: list[str]
                ) -> dict[str, dict[str, Any]]:
    """One draft-model mode per (gamma, schedule, draft weights), named by what varies."""
    modes = {}
    for gamma, schedule, stored in itertools.product(gammas, schedules, weights):
        varies = ([f"gamma {gamma}"] * (len(gammas) > 1) + [schedule] * (len(schedules) > 1)
                  + [f"{stored} weights"] * (len(weights) > 1))
        mode = "draft model" + (f" ({', '.join(varies)})" if varies else "")
        modes[mode] = {"draft_lm": draft, "num_draft_tokens": gamma,
                       "adaptive": SCHEDULES[schedule], "draft_weights": stored}
    return modes


def bench_case(case: Case, args: argparse.Namespace) -> list[dict[str, Any]]:
    from genlib.decoding.speculative import speculative_stream, summarize
    from genlib.generate import stream
    from genlib.models.loading import ModelSpec, load_model
    from genlib.settings.config import resolve_settings

    target = load_model(ModelSpec(str(MODELS / case.target), device="cpu"))
    draft = load_model(ModelSpec(str(MODELS / case.draft), device="cpu"))
    sampling = {"do_sample": True, "temperature": args.temperature, "seed": args.seed}
    settings = resolve_settings({"max_new_tokens": case.max_new_tokens, "ignore_eos": True,
                                 **(sampling if args.temperature else {})})
    plain_mode = "plain sampling" if args.temperature else "plain greedy"
    rows = []
    for prompt_name, prompt in (("open", case.prompt), ("extractive", case.extractive)):
        ids = target.encode(prompt)
        modes: dict[str, dict[str, Any]] = {plain_mode: {}}
        if prompt_name == "open":
            modes.update(draft_modes(draft, [int(g) for g in args.num_draft_tokens.split(",")],
                                     args.schedules.split(","),
                                     args.draft_weights.split(",")))
        modes["prompt lookup"] = {"prompt_lookup": args.ngram,
                                  "num_draft_tokens": args.lookup_tokens}
        if prompt_name == "open":  # both drafters: lookup first, the draft model's defaults
            modes["lookup, then draft model"] = {"draft_lm": draft, "prompt_lookup": args.ngram}
        measured = measure({mode: lambda ids=ids, kw=kw: (
            speculative_stream(target, ids, settings, **kw) if kw
            else stream(target, [ids], settings)) for mode, kw in modes.items()}, args.repeats)
        plain_tps, plain_events = measured[plain_mode]
        plain_ids = decode_rate(plain_events)[1]
        for mode, (tps, events) in measured.items():
            plain = mode == plain_mode
            # sampled runs draw their random numbers in another order: no token identity
            same = None if args.temperature else decode_rate(events)[1] == plain_ids
            rows.append(_row(case, prompt_name, mode, tps, plain_tps,
                             None if plain else summarize(events), same))
    return rows


def _row(case: Case, prompt: str, mode: str, tps: float, plain_tps: float, summary: Any,
         identical: bool | None) -> dict[str, Any]:
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
            f"{_same(r['identical'])} |")
    return "\n".join(lines)


def _same(identical: bool | None) -> str:
    return "-" if identical is None else "yes" if identical else "NO"


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
    parser.add_argument("--schedules", default="default",
                        help="the draft model's gamma schedule: a comma list of fixed, "
                             "adaptive and default (genlib's: adaptive)")
    parser.add_argument("--draft-weights", default="auto",
                        help="how the native kernel stores the draft model's matrices: a "
                             "comma list of auto (genlib's: bfloat16), float32, bfloat16")
    parser.add_argument("--pairs", default="code,stories",
                        help="which pairs to run, a comma list of code and stories")
    parser.add_argument("--code-prompt", default=CODE_PROMPT,
                        help="the code pair's open prompt")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=1, help="the sampling seed")
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    pairs = args.pairs.split(",")
    for case in [c for c in cases(args.max_new_tokens, args.code_prompt) if c.pair in pairs]:
        rows.extend(bench_case(case, args))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        decoding = (f"sampling at temperature {args.temperature:g}, seed {args.seed}"
                    if args.temperature else "greedy")
        print(f"torch threads: {torch.get_num_threads()}, {decoding}, ignore_eos, "
              f"gamma {args.num_draft_tokens}, {args.schedules} schedule (lookup "
              f"{args.lookup_tokens}, n-gram "
              f"{args.ngram}), median of {args.repeats} interleaved rounds after a warm-up\n")
        print(markdown(rows))


if __name__ == "__main__":
    main()
