"""What a grammar's token mask costs per decode step: the "grammar" stage's time (find
the row's xgrammar matcher, fill the bitmask, apply it) against the whole step of plain
decoding (forward pass, processing, sampling), same model, measured in the same run.

    python benchmarks/bench_grammar.py [--model ../shared/models/code-target] [--reps 7]
        [--backend auto|transformers|lean|compiled|native]

Each rep runs, one after the other (interleaved, so load on a shared machine hits both
alike): a plain greedy run of --steps tokens (end tokens ignored) for the step time, and
the same prompt under a JSON schema, whose grammar stage is timed call by call. Reported:
median plain step, median mask time per step, their ratio, and the mask's p90, by the
wall clock and by this thread's CPU time (on a loaded machine the wall clock of the
forward pass, which waits for memory and cores, inflates far more than the mask's: the
CPU-time ratio is the one to quote there). The schema (an array of records with free
strings) keeps the output going for many steps.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "code-target"
PROMPT = "import json\n\n\ndef load_records():\n    return "
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "path": {"type": "string"},
                       "size": {"type": "integer"}, "tags": {"type": "array",
                                                             "items": {"type": "string"}}},
        "required": ["name", "path", "size", "tags"],
    },
}


def timed_mask_fn(samples: list[float], cpu: list[float]):
    """grammar.mask_fn, each call of its processor timed into `samples` (wall clock)
    and `cpu` (this thread's CPU time)."""
    from genlib.sampling import grammar

    original = grammar.mask_fn

    def make(matchers, prompt_width):
        fn = original(matchers, prompt_width)

        def timed(token_ids, logits):
            start, start_cpu = time.perf_counter(), time.thread_time()
            out = fn(token_ids, logits)
            samples.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
            return out

        return timed

    return make


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from genlib.backends.choose import BACKENDS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="the backend both runs decode on, as genlab's --backend "
                             "(default auto: the native kernel for a float32 Llama-style "
                             "model on a CPU with a C compiler)")
    args = parser.parse_args()

    import torch

    from genlib.events import Finish, Prefill
    from genlib.generate import stream
    from genlib.models.loading import ModelSpec, load_model
    from genlib.sampling import grammar
    from genlib.settings.config import resolve_settings

    torch.set_num_threads(args.threads)
    lm = load_model(ModelSpec(args.model, device="cpu"), quick=True)
    ids = lm.encode(PROMPT)
    plain = resolve_settings({"max_new_tokens": args.steps, "ignore_eos": True})
    constrained = resolve_settings({"max_new_tokens": args.steps, "json_schema": SCHEMA})
    masks: list[float] = []
    mask_cpu: list[float] = []
    grammar.mask_fn = timed_mask_fn(masks, mask_cpu)  # the stage, timed; decode builds it per run

    ran: set[str] = set()

    def run(settings):
        for event in stream(lm, [ids], settings, backend=args.backend):
            if isinstance(event, Prefill):
                ran.add(event.backend)
            elif isinstance(event, Finish):
                return event
        raise RuntimeError("the generation ended without a Finish event")

    run(plain)  # warm-up: first-run costs (compilation, the kernel's build) stay out
    run(constrained)
    masks.clear()
    step_medians, mask_medians, mask_all, produced = [], [], [], []
    step_cpu, mask_cpu_medians = [], []
    for _ in range(args.reps):
        start_cpu = time.thread_time()
        plain_run = run(plain)
        step_cpu.append((time.thread_time() - start_cpu) / plain_run.new_tokens)
        step_medians.append((plain_run.end - plain_run.first_token)
                            / (plain_run.new_tokens - 1))
        masks.clear()
        mask_cpu.clear()
        out = run(constrained)
        mask_medians.append(statistics.median(masks))
        mask_cpu_medians.append(statistics.median(mask_cpu))
        mask_all.extend(masks)
        produced.append(out.new_tokens)
    step = statistics.median(step_medians)
    mask = statistics.median(mask_medians)
    p90 = statistics.quantiles(mask_all, n=10)[-1]
    print(f"# bench_grammar  {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  "
          f"{platform.processor() or platform.machine()}  torch threads {args.threads}")
    print(f"# command: python benchmarks/bench_grammar.py --model {Path(args.model).name} "
          f"--steps {args.steps} --reps {args.reps} --threads {args.threads} "
          f"--backend {args.backend}")
    print(f"model {Path(args.model).name}, vocab {lm.vocab_size}, {args.reps} interleaved "
          f"reps, constrained runs of {min(produced)}-{max(produced)} tokens")
    print(f"backend {', '.join(sorted(ran))} (--backend {args.backend})")
    print(f"plain decode step (median of rep medians): {step * 1e3:.3f} ms")
    print(f"grammar mask per step (median of rep medians): {mask * 1e3:.3f} ms "
          f"(p90 over all steps {p90 * 1e3:.3f} ms)")
    print(f"mask / step, wall clock: {mask / step:.1%} (per-rep: "
          + ", ".join(f"{m / s:.1%}" for m, s in zip(mask_medians, step_medians)) + ")")
    cpu_step, cpu_mask = statistics.median(step_cpu), statistics.median(mask_cpu_medians)
    print(f"CPU time (this thread; less hit by other processes' load): step "
          f"{cpu_step * 1e3:.3f} ms (whole run / tokens), mask {cpu_mask * 1e3:.3f} ms, "
          f"mask / step {cpu_mask / cpu_step:.1%}")


if __name__ == "__main__":
    main()
