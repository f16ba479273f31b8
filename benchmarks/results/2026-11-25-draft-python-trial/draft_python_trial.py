"""A trial, not landed: the draft model's proposals with the Python around each draft
step cut to the bare kernel call (no backend checks, no tensors made per step, greedy's
argmax on a preallocated logits row, EOS suppressed as --ignore-eos does), against the
ModelDrafter as it is, and plain greedy, interleaved; every mode's tokens compared.

    python draft_python_trial.py TARGET_DIR DRAFT_DIR [--rounds 15]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from genlib import drafters, speculative
from genlib.config import GenerationSettings
from genlib.generate import stream
from genlib.models import ModelSpec, load_model

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def bare_propose(self, ids, gamma, process, generator):
    """ModelDrafter.propose, greedy only, straight to the kernel."""
    begin = time.perf_counter()
    kernel, cache = self.backend.kernel, self.backend.caches[0]
    feed = list(ids)[len(self.cached):]
    if len(feed) > 1:
        kernel.extend(feed[:-1], cache, all_logits=False)
        self.cached.extend(feed[:-1])
    token = feed[-1]
    self.cached.append(token)
    view = kernel._kv(cache)
    if view.scratch is None:
        view.scratch = torch.empty(kernel._scratch_floats(ctypes.byref(kernel.model),
                                                          cache.capacity))
    logits = torch.empty(1, kernel.vocab)
    out, scratch = ctypes.c_void_p(logits.data_ptr()), ctypes.c_void_p(view.scratch.data_ptr())
    model, capacity = ctypes.byref(kernel.model), ctypes.c_long(cache.capacity)
    tokens = []
    for i in range(gamma):
        kernel._step(model, ctypes.c_long(token), ctypes.c_long(cache.length), view.keys,
                     view.values, capacity, scratch, out)
        cache.length += 1
        logits[0, 0] = -float("inf")  # EOS (id 0) suppressed, as --ignore-eos
        token = int(logits.argmax())
        tokens.append(token)
        if i < gamma - 1:
            self.cached.append(token)
    self.backend._update_length()
    return drafters.Draft(tokens, None, time.perf_counter() - begin, gamma)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    target = load_model(ModelSpec(args.target), quick=True)
    draft = load_model(ModelSpec(args.draft), quick=True)
    ids = target.encode(PROMPT)
    settings = GenerationSettings(max_new_tokens=160, ignore_eos=True, do_sample=False)
    as_is = drafters.ModelDrafter.propose

    def timed(events):
        begin, out = time.perf_counter(), []
        for event in events:
            if type(event).__name__ == "Token":
                out.append(event.token_id)
        return len(out) / (time.perf_counter() - begin), out

    def spec(propose):
        drafters.ModelDrafter.propose = propose
        return timed(speculative.speculative_stream(target, ids, settings, draft_lm=draft))

    timed(stream(target, [ids], settings))  # warm-up
    spec(as_is)
    spec(bare_propose)
    ratios = []
    print("| round | plain tok/s | drafter as is vs plain | bare drafter vs plain "
          "| bare vs as is |")
    print("| --- | --- | --- | --- | --- |")
    for r in range(args.rounds):
        plain, plain_ids = timed(stream(target, [ids], settings))
        a, a_ids = spec(as_is)
        b, b_ids = spec(bare_propose)
        assert plain_ids == a_ids == b_ids, "tokens differ"
        ratios.append(b / a)
        print(f"| {r + 1} | {plain:.0f} | {a / plain:.2f}x | {b / plain:.2f}x | {b / a:.3f} |")
    print(f"\nbare vs as is: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}; tokens identical in every mode")


if __name__ == "__main__":
    main()
