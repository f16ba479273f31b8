#!/usr/bin/env bash
# The figures in docs/performance.md: genlab's decode loop (on the backend auto picks,
# and on the lean one) against transformers' generate(), measured interleaved in one
# run, and the naive no-cache loop against the KV-cache loop. Run from the repository root, on a quiet
# machine (torch's default threads, 2 here: on a busy machine add --threads 1 to every
# command, both engines get the same setting so the ratios stay fair).
set -euo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
MODELS=../shared/models

genlab bench -m "$MODELS/stories260K" --baseline transformers --backend auto,lean --runs 5 \
    --json > "$OUT/stories260K.json"
GENLAB_LEAN=0 genlab bench -m "$MODELS/stories260K" --no-cache --new-tokens 32,64,128,256 \
    --runs 3 --no-bandwidth --json --plot "$OUT/no_cache.png" > "$OUT/no_cache.json"
if [ -d "$MODELS/code-target" ]; then
    genlab bench -m "$MODELS/code-target" --baseline transformers --backend auto,lean --runs 3 \
        --json > "$OUT/code-target.json"
    genlab bench -m "$MODELS/code-target" --baseline transformers --backend auto,lean --runs 3 \
        --dtype bfloat16 --json > "$OUT/code-target-bf16.json"
fi
# One-row products as the decode step runs them, and the read bandwidth bench measures
python benchmarks/bench_matvec.py | tee "$OUT/matvec.txt"
# genlab generate end to end (start, load, 50 tokens, exit), and where the time goes
python benchmarks/bench_startup.py --runs 5 --model "$MODELS/stories260K" \
    | tee "$OUT/startup.txt"
# code-target on the native backend against the bound as the machine's bandwidth moves (3 minutes)
if [ -d "$MODELS/code-target" ]; then
    python benchmarks/bench_bound_vs_load.py --model "$MODELS/code-target" --seconds 180 \
        > "$OUT/bound_vs_load.txt"
    tail -4 "$OUT/bound_vs_load.txt"
fi
# The native kernel on one thread against all of them, per model and for speculation
if [ -d "$MODELS/code-target" ] && [ -d "$MODELS/code-draft" ]; then
    python benchmarks/bench_threads.py --rounds 15 2>/dev/null | tee "$OUT/threads.txt"
fi
# genlab against llama.cpp in the same run, where llama-cpp-python is installed and
# LLAMA_CPP_SOURCE names a llama.cpp source tree for the conversion (bench_llamacpp.py)
if [ -n "${LLAMA_CPP_SOURCE:-}" ] && python -c "import llama_cpp" 2>/dev/null; then
    for model in stories260K code-target; do
        python benchmarks/bench_llamacpp.py --model "$MODELS/$model" \
            --convert-with "$LLAMA_CPP_SOURCE" --rounds 5 2>/dev/null
    done | tee "$OUT/llamacpp.txt"
fi
