"""The native backend: the lean forward's decode step as one C kernel
(`genlib.backends.kernel`), float32 on a CPU. The prompt and multi-token feeds run
through the lean forward in torch, over the same cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from genlib.backends.base import Capabilities
from genlib.backends.kernel import NativeStep
from genlib.backends.lean import LeanBackend
from genlib.backends.llama import LeanLlama

if TYPE_CHECKING:
    from genlib.modelinfo import LoadedModel


class NativeBackend(LeanBackend):
    """One row: prefill and multi-token extends in torch, every single token through
    the kernel."""

    name = "native"
    capabilities = Capabilities(rows=1, reorder=False, extend=True, crop=True,
                                dtypes=("float32",), devices=("cpu",))

    def __init__(self, lm: LoadedModel, lean: LeanLlama, kernel: NativeStep) -> None:
        super().__init__(lm, lean)
        self.kernel = kernel

    def _one_token(self, token: torch.Tensor) -> torch.Tensor:
        cache = self._cache()
        logits = self.kernel(int(token), cache)
        cache.length += 1
        return logits
