"""genlab's default decoding against llama.cpp and transformers `generate()` on one model,
in one run: batch 1, greedy, a prompt of exactly --prompt-len tokens and --new-tokens new
tokens (end ids ignored), timed end to end (prefill included). Each engine runs once per
round, the rounds interleaved, and each figure is the median of the rounds, so a noisy
machine slows all three alike; ratios are against transformers in the same run.

llama.cpp is what a user who only wants speed on a CPU picks instead: it runs here
through llama-cpp-python on a float32 GGUF of the same weights, on the same number of
threads, greedy (temperature 0), fed the same token ids. Its sums run in another order,
so its tokens may part from transformers' after a near tie; the report says how many of
them agree.

    pip install llama-cpp-python       # builds llama.cpp from source: minutes
    python benchmarks/bench_llamacpp.py --model ../shared/models/code-target \\
        --convert-with LLAMA_CPP_SOURCE --rounds 5

`--convert-with` names a llama.cpp source tree (a checkout, or `vendor/llama.cpp` in
llama-cpp-python's source package: `pip download --no-binary :all: --no-deps
llama-cpp-python`); its `convert_hf_to_gguf.py` writes the float32 GGUF into a temporary
folder. That converter refuses a byte-level BPE tokenizer whose pre-tokenizer it does not
know, as the code models' is: the script then files it as GPT-2's, which changes no
weight and nothing it times (the engines are fed token ids). A model with no
`tokenizer.model` goes straight to the BPE vocabulary, so the converter does not need
the sentencepiece package for it. `--gguf FILE` takes a GGUF
made beforehand instead.
"""

from __future__ import annotations

import argparse
import datetime
import runpy
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def llama_cpp_timed(gguf: str, context: int, threads: int):
    """A function (prompt ids, new tokens) -> (seconds to the first token, seconds in
    all, token ids) over llama.cpp. Each call resets the context first: llama-cpp-python
    otherwise keeps the KV cache of the last call and skips the prompt prefix it shares,
    so a repeated prompt would run without its prefill."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=context, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)

    def run(prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        llm.reset()
        start = time.perf_counter()
        first = 0.0
        out: list[int] = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            out.append(token)
            if len(out) == 1:
                first = time.perf_counter() - start
            if len(out) == new_tokens:
                break
        return first, time.perf_counter() - start, out

    return run


def llama_cpp_runner(gguf: str, context: int, threads: int):
    """A function (prompt ids, new tokens) -> (seconds, token ids) over llama.cpp."""
    timed = llama_cpp_timed(gguf, context, threads)

    def run(prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        _, seconds, out = timed(prompt, new_tokens)
        return seconds, out

    return run


def convert(model: str, source: Path, folder: Path) -> str:
    """MODEL as a float32 GGUF in `folder`, written by `source`'s convert_hf_to_gguf.py
    (see the module doc for the pre-tokenizer)."""
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    from conversion import base  # llama.cpp's converter package

    known = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    sentencepiece = base.TextModel._create_vocab_sentencepiece

    def vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError("no tokenizer.model")  # before it imports sentencepiece
        return sentencepiece(self)

    base.TextModel._create_vocab_sentencepiece = vocab_sentencepiece
    out = folder / (Path(model).name + "-f32.gguf")
    argv, sys.argv = sys.argv, ["convert_hf_to_gguf.py", model, "--outtype", "f32",
                                "--outfile", str(out)]
    try:
        runpy.run_path(str(source / "convert_hf_to_gguf.py"), run_name="__main__")
    finally:
        sys.argv = argv
    return str(out)


def agreeing(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many tokens two outputs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the Hugging Face model folder")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="a float32 GGUF of the same weights")
    source.add_argument("--convert-with", type=Path, metavar="LLAMA_CPP_SOURCE",
                        help="convert --model with this llama.cpp tree's converter")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import torch

    from genlib.lab import bench
    from genlib.models.loading import ModelSpec, load_model
    from genlib.settings.config import GenerationSettings

    threads = torch.get_num_threads()
    lm = load_model(ModelSpec(args.model))
    case = bench.Case("greedy", GenerationSettings(), args.prompt_len, args.new_tokens, 1)
    prompt = bench.exact_prompts(lm, args.prompt_len, 1)[0]
    scratch = tempfile.TemporaryDirectory()
    gguf = args.gguf or convert(args.model, args.convert_with, Path(scratch.name))
    llama = llama_cpp_runner(gguf, args.prompt_len + args.new_tokens + 8, threads)
    engines = {
        "genlab (default)": lambda: _genlab(bench, lm, prompt, case),
        "llama.cpp f32": lambda: llama(prompt, args.new_tokens),
        "transformers": lambda: _transformers(bench, lm, prompt, case),
    }
    for engine in engines.values():
        engine()  # warm-up: the kernel's build, first-touch pages, llama.cpp's graph
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            took, ids = engine()
            seconds[name].append(took)
            tokens[name] = list(ids)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · "
          f"python benchmarks/bench_llamacpp.py {shlex.join(sys.argv[1:])} · {threads} "
          f"threads · {args.rounds} interleaved rounds, medians, end to end")
    base = statistics.median(seconds["transformers"])
    print(f"{'engine':18} {'e2e s':>7} {'tok/s':>8} {'vs transformers':>16} "
          f"{'tokens agreeing':>16}")
    for name, values in seconds.items():
        median = statistics.median(values)
        agree = agreeing(tokens[name], tokens["transformers"])
        print(f"{name:18} {median:7.3f} {args.new_tokens / median:8.1f} "
              f"{base / median:15.2f}x {agree:>9d} of {args.new_tokens}")
    ratio = statistics.median(seconds["llama.cpp f32"]) / statistics.median(
        seconds["genlab (default)"])
    print(f"genlab against llama.cpp: {ratio:.2f}x")


def _genlab(bench, lm, prompt: list[int], case) -> tuple[float, tuple[int, ...]]:
    run = bench.genlab_run(lm, [prompt], case)
    return run.e2e_s, run.token_ids[0]


def _transformers(bench, lm, prompt: list[int], case) -> tuple[float, tuple[int, ...]]:
    run = bench.baseline_run(lm, [prompt], case)
    return run.e2e_s, run.token_ids[0]


if __name__ == "__main__":
    main()
