"""Small random models of each architecture the lean forward and the native kernel run,
for `genlab bench --baseline transformers` (benchmarks/results/2026-11-27-architectures.md).

    python benchmarks/make_arch_models.py OUT_DIR [--arch ARCH] [--tokenizer FOLDER]

Writes OUT_DIR/ARCH (save_pretrained: 4 layers, hidden 256, 8 heads over 4 KV heads,
intermediate 768, float32), each with the tokenizer files of --tokenizer, whose vocabulary
size it takes. mistral's window (4096) is longer than any run, as a real Mistral's is;
granite's multipliers are not 1; phi3's window is Phi-3-mini-4k's (2047). gemma2 (head_dim
32, soft-caps 50 and 30, window 4096, every other layer sliding) and gemma3 (model_type
gemma3_text: window 512 as Gemma-3-1B's, its default pattern, so all 4 layers slide) tie
their lm_head to the embeddings, as the real ones do. gpt2 (GPT2Config: 4 layers, n_embd 256,
8 heads, no grouped heads, n_inner 768, 1024 positions, gelu_new) ties its lm_head too.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "granite", "phi3", "gemma2", "gemma3", "gpt2")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def config(arch: str, vocab: int, ids: dict[str, int]):
    from transformers import AutoConfig

    if arch == "gpt2":  # its own field names; bos and eos from the tokenizer's
        return AutoConfig.for_model("gpt2", vocab_size=vocab, n_embd=256, n_layer=4,
                                    n_head=8, n_inner=768, n_positions=1024,
                                    initializer_range=0.1, **ids)
    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=768,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  max_position_embeddings=1024, initializer_range=0.1, **ids)
    extra = {"mistral": dict(sliding_window=4096),
             "phi3": dict(sliding_window=2047, pad_token_id=ids.get("eos_token_id", 0)),
             "qwen3": dict(head_dim=32),
             "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                             attention_multiplier=0.03125, logits_scaling=8.0),
             "gemma2": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=4096,
                            attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
             "gemma3": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=512)}
    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
    return AutoConfig.for_model(model_type, **{**common, **extra.get(arch, {})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", action="append", choices=ARCHS,
                        help="only this architecture (repeatable; default: all)")
    parser.add_argument("--tokenizer", type=Path, default=Path("../shared/models/code-target"))
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    source = AutoConfig.from_pretrained(args.tokenizer)
    ids = {k: getattr(source, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(source, k, None) is not None}
    for arch in args.arch or ARCHS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(arch, source.vocab_size, ids))
        folder = args.out / arch
        model.save_pretrained(folder)
        for name in TOKENIZER_FILES:
            if (args.tokenizer / name).exists():
                shutil.copy(args.tokenizer / name, folder / name)
        print(folder)


if __name__ == "__main__":
    main()
