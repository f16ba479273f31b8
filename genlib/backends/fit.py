"""What a backend asks of a model and a request before it serves them: the `Request`,
the environment switches, and the refusals several backends share.

Each backend class answers `supports(lm, request)` (why it cannot serve, or None) and
`passed_over(lm, request)` (why `auto` leaves it to a later backend, or None) from the
facts here; `genlib.backends.choose` asks them in one ordered list.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genlib.backends.llama import LeanLlama
    from genlib.models.info import LoadedModel


@dataclass(frozen=True)
class Request:
    """What a generation needs of its backend. `rows`: rows held at once (prompts times
    outputs, or beams); `reorder`: beam search; `crop`: speculative rollback; `backend`:
    the user's choice (`auto`: the first in `choose.ORDER` that serves); `weights`: how
    the native kernel stores the matrices (float32 or bfloat16, `kernel.WEIGHTS`; None:
    the model's own, on any backend); `hidden`: the method that needs the lean forward's
    hidden states (which the lean backend alone gives)."""

    rows: int = 1
    reorder: bool = False
    crop: bool = False
    backend: str = "auto"
    weights: str | None = None
    hidden: str | None = None  # what needs hidden states ("contrastive search", "DoLa")

    @property
    def one_row(self) -> bool:
        return self.rows == 1 and not self.reorder

    @property
    def many(self) -> str:
        """What holds several rows, in words."""
        return "beam search" if self.reorder else f"{self.rows} rows at once"

    def kernel_weights(self, lm: LoadedModel) -> str:
        """The matrices the native kernel reads for this request on `lm`: the ones
        `weights` asks for, else the model's quantized format (`lm.weights`), else the
        format its checkpoint stores (genlib.models.qformat: the codes as stored), else its
        float32 matrices."""
        return self.weights or lm.weights or stored_format(lm) or "float32"


def lean_allowed() -> bool:
    """False when GENLAB_LEAN=0 keeps generations (and quick loading) off the lean forward."""
    return os.environ.get("GENLAB_LEAN", "1") != "0"


def native_allowed() -> bool:
    """False when GENLAB_NATIVE=0 keeps auto off the native kernel."""
    return os.environ.get("GENLAB_NATIVE", "1") != "0"


def stored_format(lm: LoadedModel) -> str | None:
    """The quantized format `lm`'s checkpoint stores its matrices in (genlib.models.qformat);
    None for a float checkpoint."""
    stored = getattr(lm, "stored", None)
    return stored.format if stored is not None else None


_lean_models: weakref.WeakKeyDictionary[Any, LeanLlama | None] = weakref.WeakKeyDictionary()


def lean_of(lm: LoadedModel) -> LeanLlama | None:
    """`lm`'s lean forward: the one genlib.models.quickload built without transformers,
    else one over its transformers model's weights (built once per model); None when the
    model is not plain Llama-style (`llama.eligible`)."""
    from genlib.backends.llama import LeanLlama

    if lm.lean is not None:
        return lm.lean
    if lm.model not in _lean_models:
        lean = LeanLlama.from_model(lm.model)
        if lean is not None:  # a quantized checkpoint's: the kernel packs its codes as stored
            lean.stored = getattr(lm, "stored", None)
        _lean_models[lm.model] = lean
    return _lean_models[lm.model]


def weights_named(lm: LoadedModel, weights: str) -> str:
    """The native kernel's `weights` for `lm` as a backend's reason names them: with the
    output matrix's format where it is another (q8_0 beside a 4-bit format)."""
    from genlib.backends.kernel import head_format

    lean = lean_of(lm)
    head = head_format(lean, weights) if lean is not None else weights
    return weights if head == weights else f"{weights}, output matrix {head}"


def lean_refusal(lm: LoadedModel) -> str:
    """Why `lm` has no lean forward, in one line naming the config key or the
    architecture."""
    from genlib.backends.llama import refusal

    return refusal(lm.model) or "no lean forward"


def common_refusal(name: str, lm: LoadedModel, request: Request, *, native: bool = False,
                   hidden: bool = False, one_row: bool = False) -> str | None:
    """The refusals backends share: the native kernel's quantized matrices (read by the
    `native` one alone), a bitsandbytes model (run by transformers alone), hidden states
    (given by the `hidden` one alone), several rows (where the backend runs `one_row`)."""
    if request.hidden is not None and not request.one_row:
        return (f"{request.hidden} runs one row: give one prompt and one output "
                f"(num_return_sequences 1, no beams)")
    if lm.weights is not None and not native:
        return (f"the {name} backend does not read the native kernel's {lm.weights} "
                f"weights (--quantize {lm.quantize} on a CPU); --quantize 8bit or 4bit "
                f"with --backend transformers quantizes with bitsandbytes")
    if request.hidden is not None and not hidden:
        return f"the {name} backend gives no hidden states, which {request.hidden} needs"
    if one_row and not request.one_row:
        return (f"the {name} backend runs one row, and this generation needs "
                f"{request.many}")
    return None


def bitsandbytes_refusal(name: str, lm: LoadedModel, how: str = "") -> str | None:
    """Why a backend of genlib's own does not run a bitsandbytes model; None for any
    other model."""
    if lm.quantize != "none" and lm.weights is None:
        return f"the {name} backend does not run quantized models{how}"
    return None


def no_lean_refusal(name: str, lm: LoadedModel) -> str | None:
    """Why a backend over the lean forward cannot run `lm`; None where it has one."""
    if lean_of(lm) is not None:
        return None
    return (f"the {name} backend runs the lean forward, which cannot run {lm.ref}: "
            f"{lean_refusal(lm)}")


def compiled_lean(lm: LoadedModel) -> LeanLlama | None:
    """The lean forward the compiled backend compiles; None: it compiles transformers'
    forward over a static cache (also for a sliding window, which its one graph over
    every attention length does not hold)."""
    lean = lean_of(lm) if lean_allowed() else None
    return lean if lean is not None and lean.arch.uncompiled() is None else None


def compiled_refusal(lm: LoadedModel, request: Request) -> str | None:
    """Why the compiled backend cannot serve `request` on `lm` (`CompiledBackend.supports`;
    here, where the lean backend asks it too)."""
    name = "compiled"
    how = " (torch.compile cannot trace bitsandbytes' layers)"
    refusal = common_refusal(name, lm, request, one_row=True) \
        or bitsandbytes_refusal(name, lm, how)
    if refusal is not None or compiled_lean(lm) is not None:
        return refusal
    if request.crop:
        return ("the compiled backend over transformers' static cache cannot roll it "
                f"back, which speculative decoding needs ({_no_compiled_lean(lm)})")
    window = getattr(getattr(lm.model, "config", None), "sliding_window", None)
    if window:
        return (f"the compiled backend cannot run a sliding window ({window}): the "
                f"compiled lean step does not hold one, and transformers' sliding mask "
                f"recompiles at every step under torch.compile")
    return None


def _no_compiled_lean(lm: LoadedModel) -> str:
    """Why the compiled backend has no lean step to compile for `lm`."""
    if not lean_allowed():
        return "GENLAB_LEAN=0"
    lean = lean_of(lm)
    if lean is None:
        return lean_refusal(lm)
    return lean.arch.uncompiled() or "no compiled lean step"
