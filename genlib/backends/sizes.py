"""How many bytes of weights a decode step reads, as a backend holds them: every matrix
once (tied ones once), the input embedding table left out unless it is also the output
matrix (a step reads one row of it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of `tensors`, each storage counted once (tied weights share one)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        seen.setdefault(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    return sum(seen.values())


def step_bytes(model: Any) -> int:
    """The bytes of a transformers model's weights one decode step reads (the module doc)."""
    def embeddings(which: str) -> Any:  # a test's stand-in model may have none
        method = getattr(model, f"get_{which}_embeddings", None)
        return method() if method is not None else None

    inputs, outputs = embeddings("input"), embeddings("output")
    table = getattr(inputs, "weight", None)
    skipped = None if table is None or table is getattr(outputs, "weight", None) else \
        table.data_ptr()
    return tensor_bytes(p for p in model.parameters() if p.data_ptr() != skipped)
