"""A trial, not landed: does lookup-first speculation gain from giving each drafter its
own gamma? Today one schedule serves both: adaptive from 5, moved by every verify,
whichever drafter proposed. Two variants run interleaved with it, plain greedy and
prompt lookup alone in the same rounds:

- "split": lookup drafts up to a fixed 10 (lookup alone's default); the model's adaptive
  schedule moves on the model's verifies only;
- "split, both adaptive": lookup on its own adaptive schedule from 10, the model on its
  own from 5.

    python benchmarks/results/2026-11-25-lookup-first-gamma/lookup_first_gamma.py \
        ../shared/models/code-target ../shared/models/code-draft --rounds 7

code-target with code-draft, greedy, 160 new tokens, lookup n-gram 3. Decode tok/s as
`bench_speculative.py` counts it (new tokens / (finish - end of prefill)), the median
over the rounds; "per round" is the median of the variant's per-round ratio to today's.
Every mode's tokens are checked against plain greedy's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_speculative import CODE_EXTRACTIVE, CODE_PROMPT, decode_rate  # noqa: E402

import genlib.speculative as spec  # noqa: E402
from genlib import drafters  # noqa: E402
from genlib.config import resolve_settings  # noqa: E402
from genlib.generate import stream  # noqa: E402
from genlib.models import ModelSpec, load_model  # noqa: E402

PROMPTS = {"import os ... def main(argv):": CODE_PROMPT,
           "class Stack: def __init__(self):": "class Stack:\n    def __init__(self):\n",
           "def parse_args(argv):": "def parse_args(argv):\n",
           "extractive (merge_sorted again)": CODE_EXTRACTIVE}
MODES = ["plain greedy", "prompt lookup", "today", "split", "split, both adaptive"]


class Variant:
    """Which variant runs, and the lookup's own schedule while one does."""
    mode = "today"
    lookup_schedule: spec.GammaSchedule | None = None
    last_was_lookup = False


class SplitDrafter(drafters.LookupFirstDrafter):
    def start(self, prompt_ids, capacity=None):
        self.capacity = capacity
        super().start(prompt_ids, capacity)

    def propose(self, ids, gamma, process, generator, bans=None):
        if Variant.mode == "today":
            return super().propose(ids, gamma, process, generator, bans)
        own = Variant.lookup_schedule.gamma if Variant.lookup_schedule else 10
        room = self.capacity - len(ids) - 1  # as the loop caps gamma
        draft = self.lookup.propose(ids, min(own, room), process, generator)
        Variant.last_was_lookup = bool(draft.tokens)
        if draft.tokens:
            return draft
        return self.model.propose(ids, gamma, process, generator, bans)


class SplitSchedule(spec.GammaSchedule):
    def update(self, proposed: int, accepted: int) -> None:
        if Variant.mode != "today" and Variant.last_was_lookup:
            if Variant.lookup_schedule is not None:
                Variant.lookup_schedule.update(proposed, accepted)
            return
        super().update(proposed, accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    plain_schedule = spec.GammaSchedule
    spec.LookupFirstDrafter = SplitDrafter
    spec.GammaSchedule = SplitSchedule
    target = load_model(ModelSpec(args.target, device="cpu"))
    draft = load_model(ModelSpec(args.draft, device="cpu"))
    settings = resolve_settings({"max_new_tokens": 160, "ignore_eos": True})
    print("| prompt | plain greedy tok/s | prompt lookup | today | split | split, both "
          "adaptive | split / today (per round) | both adaptive / today | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, text in PROMPTS.items():
        ids = target.encode(text)

        def run(mode: str, ids=ids) -> list:
            Variant.mode = mode if mode in ("split", "split, both adaptive") else "today"
            Variant.lookup_schedule = (plain_schedule(10, adaptive=True)
                                       if mode == "split, both adaptive" else None)
            if mode == "plain greedy":
                return list(stream(target, [ids], settings))
            if mode == "prompt lookup":
                return list(spec.speculative_stream(target, ids, settings, prompt_lookup=3))
            return list(spec.speculative_stream(target, ids, settings, draft_lm=draft,
                                                prompt_lookup=3))

        for mode in MODES:  # warm-up
            run(mode)
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        tokens: dict[str, tuple[int, ...]] = {}
        for _ in range(args.rounds):
            for mode in MODES:
                rate, tokens[mode] = decode_rate(run(mode))
                rates[mode].append(rate)
        same = all(tokens[mode] == tokens["plain greedy"] for mode in MODES)
        print(_row(name, rates, same), flush=True)


def _row(name: str, rates: dict[str, list[float]], same: bool) -> str:
    med = {mode: statistics.median(r) for mode, r in rates.items()}

    def per_round(mode: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[mode], rates["today"]))

    x = {mode: f"{med[mode] / med['plain greedy']:.2f}x" for mode in MODES[1:]}
    return (f"| {name} | {med['plain greedy']:,.0f} | {x['prompt lookup']} | {x['today']} | "
            f"{x['split']} | {x['split, both adaptive']} | {per_round('split'):.3f} | "
            f"{per_round('split, both adaptive'):.3f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
