"""Which backend runs a generation: the one place that knows the rules, reads the
environment switches and takes the user's `--backend`.

`auto` picks the fastest backend that is exact for the request (greedy and beam search
token-identical to transformers' `generate()`):

| request and model | auto picks |
| --- | --- |
| a float32 Llama-style model on a CPU with a C compiler (any rows, beams too) | native |
| one row of such a model otherwise (no compiler, GENLAB_NATIVE=0) | lean |
| one row of an unquantized model in another dtype or on a GPU | compiled |
| several rows otherwise, a quantized model, or any other model | transformers |

On a GPU or in bfloat16 a step's kernel launches and casts, not its arithmetic, set the
pace, which a compiled step (torch.compile over a fixed-size cache, in inductor's
default mode: no CUDA graphs, whose fixed sizes the lean step's attention length is not)
removes; its first step compiles for seconds. An explicit backend
that cannot serve the request or the model is refused with a `ConfigError` naming what
would work, never replaced by another.

Environment: GENLAB_LEAN=0 keeps auto (and the quick start-up) off the lean forward,
GENLAB_NATIVE=0 keeps auto off the native kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from genlib.errors import ConfigError

if TYPE_CHECKING:
    from genlib.backends.base import Backend
    from genlib.backends.llama import LeanLlama
    from genlib.modelinfo import LoadedModel

BACKENDS = ("auto", "transformers", "lean", "compiled", "native")


@dataclass(frozen=True)
class Request:
    """What a generation needs of its backend. `rows`: rows held at once (prompts times
    outputs, or beams); `reorder`: beam search; `crop`: speculative rollback."""

    rows: int = 1
    reorder: bool = False
    crop: bool = False
    backend: str = "auto"


def lean_allowed() -> bool:
    """False when GENLAB_LEAN=0 keeps generations (and quick loading) off the lean forward."""
    return os.environ.get("GENLAB_LEAN", "1") != "0"


def native_allowed() -> bool:
    """False when GENLAB_NATIVE=0 keeps auto off the native kernel."""
    return os.environ.get("GENLAB_NATIVE", "1") != "0"


def check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def choose_backend(lm: LoadedModel, request: Request) -> Backend:
    """A fresh backend for one generation on `lm` (see the module doc); its `reason`
    says why it was picked."""
    name = check_name(request.backend)
    if name == "auto":
        name, reason = _auto(lm, request)
    else:
        reason = "asked for with --backend"
    backend = _build(name, lm, request)
    backend.reason = reason
    return backend


def backend_name(lm: LoadedModel, request: Request) -> str:
    """The name of the backend `choose_backend` gives `request`, without building it."""
    name = check_name(request.backend)
    return _auto(lm, request)[0] if name == "auto" else name


def _auto(lm: LoadedModel, request: Request) -> tuple[str, str]:
    one_row = request.rows == 1 and not request.reorder
    many = "beam search" if request.reorder else f"{request.rows} rows"
    if lm.quantize != "none":
        return "transformers", "a quantized model runs on transformers' forward"
    if lm.device.type != "cpu" or lm.dtype != torch_float32():
        if not one_row:
            return "transformers", f"{many} in {_dtype(lm)} on {lm.device.type}"
        return "compiled", f"one row in {_dtype(lm)} on {lm.device.type}: a compiled step"
    if not lean_allowed():
        return "transformers", "GENLAB_LEAN=0"
    lean = _lean(lm)
    if lean is None:
        return "transformers", "not a plain Llama-style model, so no lean forward"
    why_not = "GENLAB_NATIVE=0" if not native_allowed() else _kernel_missing(lean)
    if why_not is None:
        return "native", "a float32 Llama-style model on the CPU"
    if one_row:
        return "lean", why_not if why_not == "GENLAB_NATIVE=0" else \
            f"no native kernel: {why_not}"
    return "transformers", f"{many}, and no native kernel ({why_not}): the lean forward " \
                           f"runs one row"


def _dtype(lm: LoadedModel) -> str:
    return str(lm.dtype).removeprefix("torch.")


def _kernel_missing(lean: LeanLlama) -> str | None:
    from genlib.backends import kernel

    return kernel.applies(lean)


def torch_float32() -> object:
    import torch

    return torch.float32


def _lean(lm: LoadedModel) -> LeanLlama | None:
    from genlib.backends.lean import lean_model_of

    return lean_model_of(lm)


def _build(name: str, lm: LoadedModel, request: Request) -> Backend:
    """The named backend over `lm`, or a ConfigError saying why it cannot serve."""
    if name == "transformers":
        from genlib.backends.transformers import TransformersBackend

        return TransformersBackend(lm)
    if name in ("lean", "compiled") and (request.rows > 1 or request.reorder):
        what = "beam search" if request.reorder else f"{request.rows} rows at once"
        raise ConfigError(f"the {name} backend runs one row, and this generation needs "
                          f"{what}; use --backend native or transformers (or auto)")
    if name == "compiled":
        return _compiled(lm, request)
    lean = _lean(lm) if lm.quantize == "none" else None
    if lean is None:
        raise ConfigError(f"the {name} backend runs plain Llama-style models (llama, "
                          f"mistral, qwen2) unquantized, and {lm.ref} is not one; use "
                          f"--backend transformers (or auto)")
    if name == "lean":
        from genlib.backends.lean import LeanBackend

        return LeanBackend(lm, lean)
    return _native(lm, lean)


def _native(lm: LoadedModel, lean: LeanLlama) -> Backend:
    from genlib.backends import kernel
    from genlib.backends.native import NativeBackend

    why_not = kernel.applies(lean)
    step = lean.native_step() if why_not is None else None
    if step is None:
        raise ConfigError(f"the native backend cannot run here: {why_not or 'no kernel'}; "
                          f"use --backend lean (or auto)")
    return NativeBackend(lm, lean, step)


def _compiled(lm: LoadedModel, request: Request) -> Backend:
    from genlib.backends.compiled import CompiledLeanBackend, CompiledStaticBackend

    if lm.quantize != "none":
        raise ConfigError("the compiled backend does not run quantized models (torch.compile "
                          "cannot trace bitsandbytes' layers); use --backend transformers "
                          "(or auto)")
    lean = _lean(lm) if lean_allowed() else None
    if lean is not None:
        return CompiledLeanBackend(lm, lean)
    if request.crop:
        raise ConfigError("the compiled backend over transformers' static cache cannot roll "
                          "it back, which speculative decoding needs; use --backend "
                          "transformers (or auto)")
    return CompiledStaticBackend(lm)
