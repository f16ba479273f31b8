"""The model's forward pass, as the decode loops use it: prefill a (left-padded) batch
of prompts once, then feed new tokens against the KV cache (seed notes 003/004).

Everything that can be decided once (padding, whether the model accepts
`logits_to_keep`) is decided at prefill, not per step.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class KVState:
    """A batch's KV cache and what the next forward needs to extend it.

    `attention_mask` and `positions` are None when no row is padded: the model then
    derives positions from the cache length, which is what it does for a single prompt.
    """

    cache: Any
    attention_mask: torch.Tensor | None
    positions: torch.Tensor | None  # (batch,) position id of the next token per row
    length: int  # tokens in the cache (padding included)
    # transformers' model, which `extend` runs over a dynamic cache (None for the states
    # below, which extend themselves).
    model: Any = None
    # Set by `prefill_static` and `prefill_lean`: the one-token step over a preallocated
    # cache, compiled or not, (token (batch, 1), the cache length before it) -> its
    # logits. `extend` uses it for single tokens.
    step: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    # Set by `prefill_lean`: several tokens in one forward (speculative verification),
    # and rollback to a length.
    extend_many: Callable[[torch.Tensor], torch.Tensor] | None = None
    crop_to: Callable[[int], None] | None = None

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep/duplicate batch rows (beam search): row i becomes old row rows[i]."""
        self.cache.reorder_cache(rows)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.index_select(0, rows)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, rows)

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` cached tokens (speculative rollback)."""
        removed = self.length - length
        if removed <= 0:
            return
        if self.crop_to is not None:
            self.crop_to(length)
            self.length = length
            return
        self.cache.crop(-removed)  # transformers 5: a negative count removes that many
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[:, :length]
        if self.positions is not None:
            self.positions = self.positions - removed
        self.length = length


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), rows right-aligned so every row's last token is last."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def accepts_logits_to_keep(model: Any) -> bool:
    return _forward_takes_logits_to_keep(type(model))


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    # Signature inspection costs ~50 us: do it once per model class, not per call.
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def prefill(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            cache: Any = None, all_logits: bool = False) -> tuple[torch.Tensor, KVState]:
    """Run the prompts once. Returns the last position's logits (batch, vocab) as float32,
    or every position's (batch, length, vocab) with `all_logits`."""
    padded = not bool(attention_mask.all())
    kwargs: dict[str, Any] = {}
    if not all_logits and accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0) if padded else None
    out = model(input_ids=input_ids, attention_mask=attention_mask if padded else None,
                position_ids=positions, past_key_values=cache or new_cache(model),
                use_cache=True, **kwargs)
    state = KVState(
        cache=out.past_key_values,
        attention_mask=attention_mask if padded else None,
        positions=positions[:, -1] + 1 if padded else None,
        length=input_ids.shape[1],
        model=model,
    )
    logits = out.logits.float()
    return (logits if all_logits else logits[:, -1, :]), state


@torch.inference_mode()
def extend(state: KVState, tokens: torch.Tensor) -> torch.Tensor:
    """Feed `tokens` (batch, k) after the cached ones; return their logits
    (batch, k, vocab) as float32. The state grows by k."""
    k = tokens.shape[1]
    if state.step is not None:
        if k > 1 and state.extend_many is not None:
            logits = state.extend_many(tokens)
            state.length += k
            return logits
        return _static_extend(state, tokens)
    positions = None
    if state.attention_mask is not None:
        ones = state.attention_mask.new_ones((tokens.shape[0], k))
        state.attention_mask = torch.cat([state.attention_mask, ones], dim=1)
        positions = state.positions[:, None] + torch.arange(k, device=tokens.device)
        state.positions = state.positions + k
    out = state.model(input_ids=tokens, attention_mask=state.attention_mask,
                      position_ids=positions, past_key_values=state.cache, use_cache=True)
    state.cache = out.past_key_values
    state.length += k
    return out.logits.float()


# --- Static cache + torch.compile (batch 1) --------------------------------------------
# A dynamic cache grows by a concatenation every step and hands the model new shapes, so
# nothing can be compiled once for every step. A static cache is allocated at its final
# size; each step writes one slot at `cache_position`, the shapes never change, and
# torch.compile can fuse the whole one-token forward into one graph (as gpt-fast does).
# Only batch 1 takes this path: padded batches need per-row positions and masks, and
# finished rows leave the batch, both of which change shapes (decode falls back to the
# dynamic cache for them).

STATIC_BUCKET = 256  # cache lengths are rounded up to this, so compiled steps get reused
_compiled_steps: weakref.WeakKeyDictionary[Any, Callable[..., torch.Tensor]] = \
    weakref.WeakKeyDictionary()


def static_cache_length(needed: int, max_positions: int | None) -> int:
    """Slots to allocate: `needed` rounded up to a bucket, within the model's positions."""
    length = -(-needed // STATIC_BUCKET) * STATIC_BUCKET
    return min(length, max_positions) if max_positions else length


def _one_token_step(model: Any, cache: Any, token: torch.Tensor, position: torch.Tensor
                    ) -> torch.Tensor:
    out = model(input_ids=token, position_ids=position[None], cache_position=position,
                past_key_values=cache, use_cache=True)
    return out.logits.float()


def compiled_step(model: Any) -> Callable[..., torch.Tensor]:
    """`_one_token_step` compiled once per model (the first call pays the compile time)."""
    step = _compiled_steps.get(model)
    if step is None:
        step = torch.compile(_one_token_step, fullgraph=True, dynamic=False)
        _compiled_steps[model] = step
    return step


@torch.inference_mode()
def prefill_static(model: Any, input_ids: torch.Tensor, cache_length: int,
                   compile: bool = True) -> tuple[torch.Tensor, KVState]:
    """`prefill` for one unpadded prompt into a static cache of `cache_length` slots.

    The returned state's `step` runs later single tokens (compiled with `compile`), so
    `extend` keeps working on it; its `reorder`/`crop` are not supported.
    """
    from transformers import StaticCache

    if input_ids.shape[0] != 1:
        raise ValueError("the static cache path takes one prompt (batch 1)")
    cache = StaticCache(config=model.config, max_cache_len=cache_length)
    length = input_ids.shape[1]
    kwargs: dict[str, Any] = {"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}
    out = model(input_ids=input_ids, cache_position=torch.arange(length, device=input_ids.device),
                past_key_values=cache, use_cache=True, **kwargs)
    step = compiled_step(model) if compile else _one_token_step
    state = KVState(cache=cache, attention_mask=None, positions=None, length=length,
                    step=lambda token, length: step(model, cache, token, torch.tensor(
                        [length], device=token.device)))
    return out.logits[:, -1, :].float(), state


def _static_extend(state: KVState, tokens: torch.Tensor) -> torch.Tensor:
    logits = []
    for i in range(tokens.shape[1]):
        logits.append(state.step(tokens[:, i:i + 1], state.length))  # type: ignore[misc]
        state.length += 1
    return logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)


# --- Lean forward (Llama-style models, batch 1) ----------------------------------------
# transformers' forward costs a small model more in bookkeeping than in arithmetic;
# `genlib.lean` runs the same arithmetic directly (see its module doc). Set GENLAB_LEAN=0
# to keep every generation on transformers' forward.

_lean_models: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def lean_enabled() -> bool:
    """False when GENLAB_LEAN=0 switches the lean forward off everywhere."""
    import os

    return os.environ.get("GENLAB_LEAN", "1") != "0"


def lean_model(model: Any) -> Any:
    """The model's `LeanLlama` (built once per model), or None when it is not eligible
    or GENLAB_LEAN=0."""
    from genlib.lean import LeanLlama

    if not lean_enabled():
        return None
    if model not in _lean_models:
        _lean_models[model] = LeanLlama.from_model(model)
    return _lean_models[model]


def lean_of(lm: Any) -> Any:
    """`lm`'s LeanLlama: the one genlib.quickload built without transformers, else its
    transformers model's (`lean_model`); None when neither applies."""
    if lm.lean is not None and lean_enabled():
        return lm.lean
    return lean_model(lm.model)


def compiled_step_kind(lm: Any) -> str:
    """Which step --compile runs for one prompt on `lm`, as `prefill_row` chooses it:
    "native" (genlib.native's kernel over the lean forward), "torch.compile" (of the lean
    step, or of transformers' static-cache step), or "none" (a quantized model's steps
    are not compiled)."""
    lean = lean_of(lm)
    if lean is not None:
        return "native" if lean.native_step() is not None else "torch.compile"
    return "torch.compile" if lm.quantize == "none" else "none"


def prefill_row(lm: Any, input_ids: torch.Tensor, capacity: int | None = None, *,
                compile: bool = False) -> tuple[torch.Tensor | None, KVState]:
    """`prefill` for one unpadded prompt (1, T), T >= 0, with room for `capacity` tokens
    (default: the model's positions): through the lean forward when `lm` has one, its
    steps compiled with `compile`; else into a static cache with compiled steps with
    `compile` (unquantized models); else into a dynamic cache. The last position's
    logits, None for an empty prompt."""
    fast = lean_of(lm)
    if fast is not None:
        slots = static_cache_length(capacity or fast.max_positions, lm.max_positions)
        return prefill_lean(fast, input_ids, slots, compile=compile)
    if input_ids.shape[1] == 0:
        return None, KVState(new_cache(lm.model), None, None, 0, model=lm.model)
    if compile and capacity is not None and lm.quantize == "none":
        slots = static_cache_length(capacity, lm.max_positions)
        return prefill_static(lm.model, input_ids, slots, compile=True)
    return prefill(lm.model, input_ids, torch.ones_like(input_ids))


def prefill_lean(lean: Any, input_ids: torch.Tensor, cache_length: int,
                 compile: bool = False) -> tuple[torch.Tensor | None, KVState]:
    """`prefill` for one unpadded prompt through a `LeanLlama`, into a cache of its own
    with room for `cache_length` tokens; the state's `step` runs later tokens (compiled
    with `compile`), so `extend` keeps working on it. Its `reorder` is not supported."""
    cache = lean.new_cache(cache_length)
    logits = lean.prefill(input_ids, cache)
    run = lean.compiled_step if compile else lean.step
    state = KVState(cache=cache, attention_mask=None, positions=None,
                    length=input_ids.shape[1],
                    step=lambda token, length: run(token, cache)[:, None],
                    extend_many=lambda tokens: lean.extend(tokens, cache),
                    crop_to=cache.crop)
    return logits, state
