"""Whether a generation can fit in memory, checked before any work: rows and lengths
come from the user (--batch-size, --num-beams, --num-return-sequences, prompt and new
tokens), and a size that cannot fit would otherwise run the machine out of memory or
build inputs for minutes before failing.

The estimate is what grows with them: the KV cache,
`layers x 2 x kv_heads x head_dim x positions x rows x dtype bytes`, and one step's
float32 logits, `rows x vocab x 4`. The weights are already loaded, so what is available
now is what the generation may take.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from genlib.errors import UserInputError

if TYPE_CHECKING:
    import torch

    from genlib.models.info import LoadedModel
    from genlib.settings.config import GenerationSettings

REMEDY = "lower --batch-size, --num-beams, --num-return-sequences or max_new_tokens"


class TooLargeError(UserInputError):
    """A generation that cannot fit in the memory available (exit 2)."""


def rows_of(prompts: int, settings: GenerationSettings) -> int:
    """Rows the decode loop keeps a KV cache for: each prompt's beams, or its outputs."""
    per_prompt = settings.num_beams if settings.strategy == "beam" else \
        settings.num_return_sequences
    return prompts * per_prompt


def check_memory(lm: LoadedModel, rows: int, positions: int, remedy: str = REMEDY) -> None:
    """TooLargeError when `rows` rows of `positions` tokens (prompt + new) need more
    memory than is available on the model's device; nothing when either is unknown."""
    shape = kv_shape(lm)
    available = available_bytes(lm.device)
    if shape is None or available is None:
        return
    layers, kv_heads, head_dim = shape
    cache = layers * 2 * kv_heads * head_dim * positions * rows * lm.dtype.itemsize
    logits = rows * lm.vocab_size * 4
    if cache + logits <= available:
        return
    raise TooLargeError(
        f"{rows:,} rows of {positions:,} tokens need about {_size(cache + logits)} of "
        f"memory (KV cache {_size(cache)}, logits {_size(logits)}), but "
        f"{_size(available)} is available on {lm.device.type}; {remedy}")


def kv_shape(lm: LoadedModel) -> tuple[int, int, int] | None:
    """(layers, KV heads, head dim) of the model, without loading a deferred one; None
    for a configuration that does not say."""
    if lm.lean is not None:
        # num_layers, not len(layers): the torch forward's layers are made on first use,
        # copies of the matrices the native kernel never needs
        return lm.lean.num_layers, lm.lean.kv_heads, lm.lean.head_dim
    config: Any = getattr(getattr(lm, "model", None), "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (isinstance(layers, int) and isinstance(heads, int) and heads > 0):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden else None)
    if not isinstance(head_dim, int):
        return None
    return layers, int(kv_heads), head_dim


def available_bytes(device: torch.device) -> int | None:
    """Memory a generation may still take: the GPU's free memory, or on a CPU the
    kernel's MemAvailable (free plus reclaimable caches), else free pages; None where
    neither can be read."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _size(count: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count / 1024:,.1f} KiB"
