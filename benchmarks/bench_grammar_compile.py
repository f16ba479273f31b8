"""What a grammar's compile costs, and what reading it back from genlab's disk cache
would cost instead: xgrammar's compile, serialize_json and deserialize_json, timed on
one tokenizer for a 7-property schema and for flat objects of N optional keys.

    python benchmarks/bench_grammar_compile.py --model ../shared/models/code-target
    python benchmarks/bench_grammar_compile.py --keys 200,500,1000 --reps 1
    python benchmarks/bench_grammar_compile.py --cache --reps 5

Each row also gives genlab's estimate of the serialized size (rules x compiled size /
10, `genlib.sampling.grammar_cache.worth_storing`) and whether genlab would store the grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's genlib

SMALL = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
             "maxItems": 5},
    "address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city"]},
    "active": {"type": "boolean"}, "score": {"type": "number"}},
    "required": ["name", "age", "email"]}


def flat(keys: int) -> dict:
    return {"type": "object",
            "properties": {f"key_{i}": {"type": "string"} for i in range(keys)}}


def timed(call):
    started = time.perf_counter()
    value = call()
    return value, time.perf_counter() - started


def measure(info, schema: dict, reps: int) -> dict:
    import xgrammar

    from genlib.sampling import grammar_cache

    text = json.dumps(schema, separators=(",", ":"))
    compiles, writes, reads = [], [], []
    for _ in range(reps):
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled, seconds = timed(partial(compiler.compile_json_schema, text,
                                          any_whitespace=False))
        compiles.append(seconds)
        body, seconds = timed(compiled.serialize_json)
        writes.append(seconds)
        _, seconds = timed(partial(xgrammar.CompiledGrammar.deserialize_json, body, info))
        reads.append(seconds)
    rules = str(compiled.grammar).count("\n") + 1
    compile_s = statistics.median(compiles)
    return {"schema bytes": len(text), "rules": rules,
            "compiled MB": compiled.memory_size_bytes / 1e6,
            "compile s": compile_s, "serialize s": statistics.median(writes),
            "deserialize s": statistics.median(reads), "JSON MB": len(body) / 1e6,
            "estimate MB": rules * compiled.memory_size_bytes / 10 / 1e6,
            "stored": grammar_cache.worth_storing(compiled, compile_s)}


def cold_and_warm(tokenizer, reps: int) -> None:
    """genlib's compile_for on the 7-property schema: each repetition in a new cache
    folder with the memory cache cleared, first cold (compile and store), then warm
    (read back from the disk cache)."""
    import os
    import tempfile

    from genlib.sampling import grammar
    from genlib.settings.config import resolve_settings

    settings = resolve_settings({"json_schema": SMALL})
    vocab = len(tokenizer)
    grammar.compile_for(tokenizer, vocab, [0], settings)  # the tokenizer's view, once
    cold, warm = [], []
    for _ in range(reps):
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()
        for times in (cold, warm):
            grammar._COMPILED.clear()
            times.append(timed(partial(grammar.compile_for, tokenizer, vocab, [0],
                                       settings))[1])
    for name, times in (("cold (compile + store)", cold), ("warm (disk cache)", warm)):
        print(f"{name} s: {[round(t, 3) for t in times]} median "
              f"{statistics.median(times):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="../shared/models/code-target")
    parser.add_argument("--keys", default="200,500,1000", help="flat objects' key counts")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cache", action="store_true",
                        help="time genlab's compile_for cold and warm instead")
    args = parser.parse_args()
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.cache:
        return cold_and_warm(tokenizer, args.reps)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    cases = [("7 properties", SMALL)] + [(f"{n} optional keys", flat(int(n)))
                                         for n in args.keys.split(",") if n]
    for name, schema in cases:
        row = measure(info, schema, args.reps if len(json.dumps(schema)) < 20_000 else 1)
        print(name + ": " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
