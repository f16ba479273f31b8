#!/usr/bin/env bash
# The figures in the README's performance section: genlab's decode loop (default and
# --compile) against transformers' generate(), measured interleaved in one run, and the
# naive no-cache loop against the KV-cache loop. Run from the repository root.
#
# --threads 1: the models are tiny, and on a shared 2-core machine a second intra-op
# thread mostly waits at barriers for a core another process holds (both engines get the
# same setting, so the ratios stay fair). Drop it on a quiet machine to compare.
set -euo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
MODELS=../shared/models

genlab bench -m "$MODELS/stories260K" --baseline transformers --compile \
    --prompt-len 128 --new-tokens 256 --runs 5 --threads 1 --json > "$OUT/stories260K.json"
genlab bench -m "$MODELS/stories260K" --no-cache --new-tokens 32,64,128,256 \
    --runs 3 --threads 1 --no-bandwidth --json --plot "$OUT/no_cache.png" > "$OUT/no_cache.json"
if [ -d "$MODELS/code-target" ]; then
    genlab bench -m "$MODELS/code-target" --baseline transformers --compile \
        --prompt-len 128 --new-tokens 256 --runs 3 --threads 1 --json > "$OUT/code-target.json"
fi
# genlab generate end to end (start, load, 50 tokens, exit)
/usr/bin/time -f "generate end to end: %e s wall, %U s user" \
    genlab generate -m "$MODELS/stories260K" -n 50 "Once upon a time" > /dev/null
