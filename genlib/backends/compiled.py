"""The compiled backend: a one-token step under torch.compile over a fixed-size cache.

Over the lean forward where the model allows it (its step compiled as one graph that
reads the cache length from a tensor, `LeanLlama.compiled_step`); otherwise over
transformers' forward with a static cache (every shape fixed, as gpt-fast does), which
serves any unquantized model on any device. The first step compiles (seconds); the
prompt runs uncompiled."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from genlib.backends.base import Backend, Capabilities
from genlib.backends.direct import compile_errors
from genlib.backends.lean import LeanBackend, cache_capacity
from genlib.backends.transformers import accepts_logits_to_keep, cache_keyword, cache_kwargs

if TYPE_CHECKING:
    from genlib.models.info import LoadedModel


class CompiledLeanBackend(LeanBackend):
    """The lean forward with its single-token step under torch.compile."""

    name = "compiled"

    def _one_token(self, token: torch.Tensor) -> torch.Tensor:
        return self.lean.compiled_step(token, self._cache())


_compiled_steps: weakref.WeakKeyDictionary[Any, Callable[..., torch.Tensor]] = \
    weakref.WeakKeyDictionary()


def _one_token_step(model: Any, cache: Any, token: torch.Tensor, position: torch.Tensor,
                    keyword: str) -> torch.Tensor:
    """One token through the forward; `keyword` names its cache argument (decided
    outside the compiled graph: `cache_keyword`)."""
    out = model(input_ids=token, position_ids=position[None], cache_position=position,
                use_cache=True, **{keyword: cache})
    return out.logits.float()


def compiled_step(model: Any) -> Callable[..., torch.Tensor]:
    """`_one_token_step` compiled once per model (the first call pays the compile time)."""
    step = _compiled_steps.get(model)
    if step is None:
        step = torch.compile(_one_token_step, fullgraph=True, dynamic=False)
        _compiled_steps[model] = step
    return step


class CompiledStaticBackend(Backend):
    """transformers' forward over a static cache, one row, its single-token step
    compiled. Several tokens are fed one step at a time; the cache cannot be cropped."""

    name = "compiled"
    capabilities = Capabilities(rows=1, reorder=False, extend=True, crop=False)

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        lm.load_model_now()
        self.model = lm.model
        self.cache: Any = None

    @torch.inference_mode()
    def _prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor | None:
        from transformers import StaticCache

        slots = cache_capacity(capacity, self.lm.max_positions)
        self.cache = StaticCache(config=self.model.config, max_cache_len=slots)
        ids = torch.tensor([list(rows[0])], dtype=torch.long, device=self.lm.device)
        self.length = ids.shape[1]
        if self.length == 0:
            return None
        kwargs = {"logits_to_keep": 1} if accepts_logits_to_keep(self.model) else {}
        out = self.model(input_ids=ids, cache_position=torch.arange(self.length,
                                                                    device=ids.device),
                         use_cache=True, **cache_kwargs(self.model, self.cache), **kwargs)
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        position = torch.tensor([self.length], device=tokens.device)
        with compile_errors(self.lm.dtype, self.lm.device, uncompiled="transformers"):
            logits = compiled_step(self.model)(self.model, self.cache, tokens.view(1, 1),
                                               position, cache_keyword(self.model))
        self.length += 1
        return logits[:, -1]

    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.stack([self._step(tokens[:, i]) for i in range(tokens.shape[1])], dim=1)
