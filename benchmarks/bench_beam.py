"""Beam search speed and peak memory: genlib.decoding.beam vs transformers' generate(num_beams=k),
same model, prompt and number of steps, measured in the same run.

    python benchmarks/bench_beam.py [--model ../shared/models/stories260K] [--steps 128]

Each (implementation, k) runs in its own subprocess, so peak RSS (ru_maxrss) is its own;
inside it, one warm-up run and then --reps timed runs (median reported). End tokens are
suppressed (min_new_tokens = max_new_tokens) so both do exactly --steps steps.
tokens/s counts output tokens (steps / s); beam-tokens/s counts k tokens per step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260K"
PROMPT = "Once upon a time, there was a little girl who"


def run_one(impl: str, model: str, k: int, steps: int, reps: int, threads: int
            ) -> dict[str, float]:
    """Inside the child process: time `reps` runs, report the median and peak RSS."""
    import torch

    sys.path.insert(0, str(ROOT))
    from genlib.decoding.beam import beam_search
    from genlib.models.loading import ModelSpec, load_model
    from genlib.settings.config import GenerationSettings

    torch.set_num_threads(threads)
    lm = load_model(ModelSpec(model, device="cpu"))
    ids = lm.encode(PROMPT)
    settings = GenerationSettings(strategy="beam", num_beams=k, max_new_tokens=steps,
                                  min_new_tokens=steps)

    def once() -> int:
        if impl == "genlab":
            return len(beam_search(lm, [ids], settings)[0].hypotheses[0].token_ids)
        out = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                dtype=torch.long), num_beams=k, do_sample=False,
                                max_new_tokens=steps, min_new_tokens=steps,
                                eos_token_id=list(lm.eos_ids), pad_token_id=lm.pad_id)
        return out.shape[1] - len(ids)

    once()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        produced = once()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = statistics.median(times)
    return {"seconds": seconds, "tokens": produced, "tok_s": produced / seconds,
            "cpu_tok_s": produced / statistics.median(cpu),
            "beam_tok_s": produced * k / seconds, "peak_rss_mib": peak / 1024,
            "growth_mib": (peak - base_rss) / 1024}


def child(impl: str, args: argparse.Namespace, k: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", impl, "--model", args.model, "--k", str(k),
           "--steps", str(args.steps), "--reps", str(args.reps), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--beams", default="1,4,8")
    parser.add_argument("--child")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the tiny model gains nothing from more, and "
                             "a shared machine gives steadier figures)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.model, args.k, args.steps, args.reps,
                                 args.threads)))
        return
    print(f"model {args.model}, {args.steps} steps, median of {args.reps} runs, CPU, "
          f"{args.threads} thread(s); tok/s from wall time (CPU time in brackets)")
    print("| k | genlab tok/s | transformers tok/s | ratio | genlab peak RSS MiB | "
          "transformers peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in (int(x) for x in args.beams.split(",")):
        ours = child("genlab", args, k)
        theirs = child("transformers", args, k)
        print(f"| {k} | {ours['tok_s']:.1f} ({ours['cpu_tok_s']:.1f}) | "
              f"{theirs['tok_s']:.1f} ({theirs['cpu_tok_s']:.1f}) | "
              f"{ours['tok_s'] / theirs['tok_s']:.2f}x "
              f"({ours['cpu_tok_s'] / theirs['cpu_tok_s']:.2f}x) | {ours['peak_rss_mib']:.0f} | "
              f"{theirs['peak_rss_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
