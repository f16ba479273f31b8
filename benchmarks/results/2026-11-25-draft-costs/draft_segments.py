"""Where a draft model's step goes in a speculative run (code-target with code-draft,
greedy, 160 tokens): ModelDrafter.propose as genlib runs it, timed segment by segment.

    python benchmarks/results/2026-11-25-draft-costs/draft_segments.py TARGET DRAFT
"""

from __future__ import annotations

import math
import sys
import time

from genlib import drafters
from genlib.config import resolve_settings
from genlib.drafters import Draft, _as_batch
from genlib.models import ModelSpec, load_model
from genlib.speculative import speculative_stream, summarize

target = load_model(ModelSpec(sys.argv[1], device="cpu"))
draft = load_model(ModelSpec(sys.argv[2], device="cpu"))
settings = resolve_settings({"max_new_tokens": 160, "ignore_eos": True})
ids = target.encode("import os\nimport sys\n\n\ndef main(argv):\n    ")
spent: dict[str, float] = {}


def lap(name: str, start: float) -> float:
    now = time.perf_counter()
    spent[name] = spent.get(name, 0.0) + now - start
    return now


def propose(self, ids, gamma, process, generator, bans=None):  # greedy: the loop, laps
    begin = t = time.perf_counter()
    context = list(ids)
    feed = context[len(self.cached):]
    tokens, forwards = [], 0
    for i in range(gamma):
        batch = _as_batch(feed, self.lm)
        t = lap("input tensor", t)
        logits = self.backend.extend(batch)[0, -1]
        t = lap("backend extend (kernel call included)", t)
        forwards += 1
        self.cached.extend(feed)
        q_logits = process(context, logits, i)
        t = lap("processing", t)
        top, best = q_logits.max(dim=-1)
        if not float(top) > -math.inf:
            break
        t = lap("max and stop test", t)
        tokens.append(int(best))
        context.append(tokens[-1])
        feed = [tokens[-1]]
    return Draft(tokens, None, time.perf_counter() - begin, forwards)


drafters.ModelDrafter.propose = propose
list(speculative_stream(target, ids, settings, draft_lm=draft))  # warm-up
for _ in range(5):
    spent.clear()
    s = summarize(speculative_stream(target, ids, settings, draft_lm=draft))
    parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in spent.items())
    print(f"{s.draft_forwards} draft steps, {s.draft_seconds * 1e3:.1f} ms drafting "
          f"({s.draft_seconds / s.draft_forwards * 1e6:.0f} us a step): {parts}")
