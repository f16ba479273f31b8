"""Decode speed of the native kernel's weight formats (float32, q8_0, nf4, q4_0) on one
model, batch 1, interleaved: each round runs every format once (a --prompt-len prompt
fed in one call, then --new-tokens one-token steps timed), after --warmup untimed
rounds, and each figure is the median of the rounds, so a noisy machine slows every
format alike; the time to the first token (the prompt's prefill and the first pick) is
reported beside it. With --gguf FILE (repeatable; llama-cpp-python installed),
llama.cpp decodes the same prompt in the same rounds (`bench_llamacpp.llama_cpp_timed`,
a fresh context each call; its decode: the tokens after the first over the time after
the first, in one call).

    python ../shared/tools/make_sized.py /tmp/smol360 --shape smollm2-360m \\
        --tokenizer ../shared/models/code-target      # a 330M random Llama
    python benchmarks/bench_quantized.py --model /tmp/smol360 --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def genlab_decode(step, lean, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(Seconds to the first token: the prompt in one call, tokens a second over
    `new_tokens` greedy one-token steps after it)."""
    cache = lean.new_cache(len(prompt) + new_tokens + 1)
    start = time.perf_counter()
    logits = step.extend(prompt, cache, all_logits=False)
    int(logits.argmax())
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = step(int(logits.argmax()), cache)
        cache.length += 1
    return first, new_tokens / (time.perf_counter() - start)


def llama_cpp_decode(run, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """llama.cpp's (seconds to the first token, decode tokens a second: the tokens
    after the first over the time after the first), in one call
    (`bench_llamacpp.llama_cpp_timed`)."""
    first, whole, out = run(prompt, new_tokens + 1)
    return first, (len(out) - 1) / (whole - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--formats", default="float32,q8_0,nf4,q4_0")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds first (first-touch pages, llama.cpp's mmap)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", action="append", default=[])
    args = parser.parse_args()

    import torch

    from genlib.backends.kernel import NativeStep
    from genlib.backends.lean import lean_model_of
    from genlib.models.loading import ModelSpec, load_model

    torch.set_num_threads(args.threads)
    lm = load_model(ModelSpec(args.model), quick=True)
    lean = lean_model_of(lm)
    random.seed(0)
    prompt = [random.randrange(3, lean.embed.shape[0]) for _ in range(args.prompt_len)]
    engines = {f"genlab {name}": partial(genlab_decode, NativeStep(lean, args.threads,
                                                                   weights=name),
                                         lean, prompt, args.new_tokens)
               for name in args.formats.split(",")}
    if args.gguf:
        from bench_llamacpp import llama_cpp_timed

        context = args.prompt_len + args.new_tokens + 8
        for gguf in args.gguf:
            engines[f"llama.cpp {Path(gguf).name}"] = partial(
                llama_cpp_decode, llama_cpp_timed(gguf, context, args.threads), prompt,
                args.new_tokens)
    for _ in range(args.warmup):
        for engine in engines.values():
            engine()
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            figures[name].append(engine())
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"{now:%Y-%m-%d %H:%M} UTC; {args.model}; prompt {args.prompt_len}, "
          f"{args.new_tokens} new, {args.threads} threads, {args.warmup} untimed and "
          f"{args.rounds} timed rounds")
    print(f"python benchmarks/bench_quantized.py {' '.join(sys.argv[1:])}\n")
    print("| engine | decode tok/s (median) | rounds | vs genlab float32 "
          "| first token ms (median) |")
    print("| --- | --- | --- | --- | --- |")
    base = statistics.median(v for _, v in next(iter(figures.values())))
    for name, pairs in figures.items():
        values = [v for _, v in pairs]
        median = statistics.median(values)
        first = statistics.median(f for f, _ in pairs)
        print(f"| {name} | {median:.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{median / base:.2f}x | {first * 1000:.0f} |")

if __name__ == "__main__":
    main()
