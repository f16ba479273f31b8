"""The compiled backend: a one-token step under torch.compile over a fixed-size cache.

Over the lean forward where the model allows it (its step compiled as one graph that
reads the cache length from a tensor, `lean_compiled_step`); otherwise over
transformers' forward with a static cache (every shape fixed, as gpt-fast does), which
serves any unquantized model on any device. The first step compiles (seconds); the
prompt runs uncompiled."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from genlib.backends.base import Backend, Capabilities
from genlib.backends.direct import DirectCompiled, compile_errors
from genlib.backends.fit import compiled_lean, compiled_refusal
from genlib.backends.lean import LeanBackend, cache_capacity
from genlib.backends.llama import LeanCache, LeanLlama
from genlib.backends.transformers import accepts_logits_to_keep, cache_keyword, cache_kwargs

if TYPE_CHECKING:
    from genlib.backends.fit import Request
    from genlib.models.info import LoadedModel


class CompiledBackend(Backend):
    """The compiled backend as `choose` asks it: `build` gives the lean forward's step
    compiled (`CompiledLeanBackend`) where the model has one that compiles, else
    transformers' forward over a static cache (`CompiledStaticBackend`)."""

    name = "compiled"

    @classmethod
    def supports(cls, lm: LoadedModel, request: Request) -> str | None:
        return compiled_refusal(lm, request)

    @classmethod
    def passed_over(cls, lm: LoadedModel, request: Request) -> str | None:
        if lm.dtype_name != "float32":
            return (f"in {lm.dtype_name} a compiled step sums in another order than "
                    f"transformers' and flips greedy near-ties (--backend compiled asks "
                    f"for it)")
        if lm.device.type == "cpu":
            return "on a CPU auto leaves the compiled step to --backend compiled"
        return None

    @classmethod
    def picked(cls, lm: LoadedModel, request: Request) -> str:
        return f"one row in {lm.dtype_name} on {lm.device.type}: a compiled step"

    @classmethod
    def build(cls, lm: LoadedModel, request: Request) -> Backend:
        lean = compiled_lean(lm)
        return CompiledLeanBackend(lm, lean) if lean is not None else CompiledStaticBackend(lm)


class CompiledLeanBackend(LeanBackend):
    """The lean forward with its single-token step under torch.compile."""

    name = "compiled"

    def _one_token(self, token: torch.Tensor) -> torch.Tensor:
        return lean_compiled_step(self.lean, token, self._cache())


SMALL_BYTES = 8 << 20  # weights below this run their compiled step on one thread
_lean_steps: weakref.WeakKeyDictionary[LeanLlama, DirectCompiled] = weakref.WeakKeyDictionary()


@torch.inference_mode()
def lean_compiled_step(lean: LeanLlama, token: torch.Tensor, cache: LeanCache) -> torch.Tensor:
    """`lean.step` under torch.compile (`LeanLlama._static_step`; the first call per
    cache capacity compiles, and later ones skip dynamo's guards: DirectCompiled); the
    first token of an empty cache runs eagerly (see `_static_step`)."""
    if cache.length >= cache.capacity:
        raise ValueError(f"{cache.length + 1} tokens exceed the KV buffers' "
                         f"{cache.capacity}")
    if cache.length == 0:
        return lean.step(token, cache)
    compiled = _lean_steps.get(lean)
    if compiled is None:
        compiled = _lean_steps[lean] = DirectCompiled(
            lean._static_step, compile_options(lean),
            dynamo_config={"capture_scalar_outputs": True})
    cache.position.fill_(cache.length)
    cache.token.copy_(token)  # the same input tensor on every step, as the position
    with compile_errors(lean.dtype, lean.device, uncompiled="lean"):
        logits = compiled(cache.capacity, cache.token, cache.position, cache.keys,
                          cache.values)
    cache.length += 1
    return logits


def is_small(lean: LeanLlama) -> bool:
    """Whether `lean`'s matrices are small enough to run its compiled step on one thread."""
    projections = [lean.lm_head] + [p for layer in lean.layers
                                    for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return sum(p.w.numel() * p.w.element_size() for p in projections) < SMALL_BYTES


def compile_options(lean: LeanLlama) -> dict[str, Any]:
    """Inductor's options for `lean`'s step. The C++ wrapper saves a Python call per
    kernel. Inductor inlines a pointwise producer into the reduction that reads it, so
    each product's inner loop would recompute its normalized input (the residual adds,
    the RMS scale, the norm weight) for every output row, several loads and a division
    per 16 weights: with no opcount allowance every pointwise result is stored once and
    the products are plain dot products (about a quarter faster where the weights are in
    cache). A small model's kernels are shorter than waking a second thread for each of
    them: run those on one."""
    options: dict[str, Any] = {"cpp_wrapper": True, "realize_opcount_threshold": 0}
    if is_small(lean):
        options["cpp.threads"] = 1
    return options


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
