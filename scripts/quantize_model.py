"""Write a model folder as genlab's quantized checkpoint (docs/models.md): its weight
matrices in q8_0, nf4 or q4_0 (beside a 4-bit format the output matrix in q8_0), the
norms as they are, the tokenizer files, generation config and README copied. The same
input gives the same bytes.

    python scripts/quantize_model.py SRC OUT --format q8_0
    genlab generate -m OUT "def f("          # runs the stored codes on the native kernel
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a float model folder (model.safetensors)")
    parser.add_argument("out", type=Path, help="the folder to write (new, or empty)")
    parser.add_argument("--format", required=True, choices=("q8_0", "nf4", "q4_0"),
                        help="q8_0: 8-bit codes, blocks of 32; nf4: 4-bit NF4, blocks of 64; "
                             "q4_0: 4-bit, blocks of 32 (the 4-bit ones keep the output "
                             "matrix in q8_0)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from genlib.models.qwrite import QuantizeError, write

    try:
        done = write(args.source, args.out, args.format)
    except QuantizeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {done.out}: {done.matrices} matrices in {done.format}, "
          f"{done.out_bytes / 1e6:.2f} MB (from {done.source_bytes / 1e6:.2f} MB)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
