"""The draft model's greedy draft in one kernel call (`NativeStep.draft_greedy`) against
the drafter's loop of one backend call a draft step, and plain greedy, interleaved on
code-target with code-draft (bfloat16 draft matrices, greedy, ignore_eos, 160 tokens);
both drafts' verifies and every mode's tokens compared.

    python whole_draft.py TARGET_DIR DRAFT_DIR [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from genlib.backends.native import NativeBackend
from genlib.config import resolve_settings
from genlib.events import Finish, Prefill, Token, Verify
from genlib.generate import stream
from genlib.models import ModelSpec, load_model
from genlib.speculative import speculative_stream

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
WHOLE = NativeBackend.capabilities
LOOP = dataclasses.replace(WHOLE, greedy_draft=False)


def rate(events: list) -> float:
    """New tokens over the seconds from the prefill's end to the finish."""
    prefill = next(e for e in events if isinstance(e, Prefill))
    finish = next(e for e in events if isinstance(e, Finish))
    return finish.new_tokens / (finish.end - prefill.time)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    target = load_model(ModelSpec(args.target, device="cpu"))
    draft = load_model(ModelSpec(args.draft, device="cpu"))
    ids = target.encode(PROMPT)
    settings = resolve_settings({"max_new_tokens": 160, "ignore_eos": True})

    def speculate(capabilities) -> list:
        NativeBackend.capabilities = capabilities
        return list(speculative_stream(target, ids, settings, draft_lm=draft))

    rates: dict[str, list[float]] = {"plain": [], "loop": [], "whole": []}
    seen = {}
    for round_ in range(args.rounds + 1):  # the first round warms up, not counted
        runs = {"plain": list(stream(target, [ids], settings)),
                "loop": speculate(LOOP), "whole": speculate(WHOLE)}
        for name, events in runs.items():
            tokens = [e.token_id for e in events if isinstance(e, Token)]
            verifies = [(e.proposed, e.accepted) for e in events if isinstance(e, Verify)]
            if seen.setdefault("tokens", tokens) != tokens:
                raise SystemExit(f"{name}: other tokens than the first run's")
            if name != "plain" and seen.setdefault("verifies", verifies) != verifies:
                raise SystemExit(f"{name}: other drafts than the first run's")
            if round_:
                rates[name].append(rate(events))
        if round_:
            print(f"round {round_}: " + ", ".join(f"{name} {values[-1]:.0f} tok/s"
                                                 for name, values in rates.items()), flush=True)

    def ratio(a: str, b: str) -> str:
        values = [x / y for x, y in zip(rates[a], rates[b])]
        return f"median {statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f})"

    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(f"loop vs plain: {ratio('loop', 'plain')}")
    print(f"whole vs plain: {ratio('whole', 'plain')}")
    print(f"whole vs loop: {ratio('whole', 'loop')}")
    print("tokens identical in every mode, the same drafts from both drafters")


if __name__ == "__main__":
    main()
