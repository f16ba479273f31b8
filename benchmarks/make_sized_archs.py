"""Models of real models' shapes in the architectures genlab runs, with random weights and
code-target's tokenizer, for speed at sizes users run (decode speed does not depend on
the weights' values): a Qwen3-0.6B and a Gemma-3-1B (text) shape, beside the Llama
shapes of `../shared/tools/make_sized.py`. The vocabulary is the tokenizer's (8,192),
not the real models' (151,936 and 262,144), as there.

    python benchmarks/make_sized_archs.py OUT_DIR [--shape qwen3-0.6b] [--shape gemma3-1b]
        [--tokenizer FOLDER]

Writes OUT_DIR/SHAPE (save_pretrained, float32), each with the tokenizer files.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

# The public models' configs (Qwen/Qwen3-0.6B, google/gemma-3-1b-pt), but the vocabulary.
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 intermediate_size=3072, rms_norm_eps=1e-6,
                                 rope_theta=1_000_000.0, max_position_embeddings=40960,
                                 tie_word_embeddings=True)),
    "gemma3-1b": ("gemma3_text", dict(hidden_size=1152, num_hidden_layers=26,
                                      num_attention_heads=4, num_key_value_heads=1,
                                      head_dim=256, intermediate_size=6912,
                                      rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                                      rope_local_base_freq=10_000.0, sliding_window=512,
                                      query_pre_attn_scalar=256,
                                      max_position_embeddings=32768,
                                      tie_word_embeddings=True)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def build(shape: str, vocab: int, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = SHAPES[shape]
    config = AutoConfig.for_model(model_type, vocab_size=vocab, bos_token_id=0,
                                  eos_token_id=0, pad_token_id=0, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{out}: {model_type}, {params / 1e6:.0f}M parameters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES))
    parser.add_argument("--tokenizer", type=Path, default=Path("../shared/models/code-target"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(args.tokenizer))
    for shape in args.shape or sorted(SHAPES):
        folder = args.out / shape
        build(shape, vocab, folder)
        for name in TOKENIZER_FILES:
            if (args.tokenizer / name).is_file():
                shutil.copy(args.tokenizer / name, folder / name)


if __name__ == "__main__":
    main()
