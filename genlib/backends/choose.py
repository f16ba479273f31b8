"""Which backend runs a generation: the one place that knows the rules, reads the
environment switches and takes the user's `--backend`.

`auto` picks the fastest backend that is exact for the request (greedy and beam search
token-identical to transformers' `generate()`):

| request and model | auto picks |
| --- | --- |
| a float32 Llama-style model (arch.ARCHITECTURES) on a CPU with a compiler | native |
| one row of such a model otherwise (no compiler, GENLAB_NATIVE=0) | lean |
| one row of a Llama-style model in bfloat16/float16, on a CPU or a GPU | lean |
| one row of an unquantized float32 model on a GPU | compiled |
| `--quantize` on a CPU, a Llama-style model (any rows) | native, its matrices quantized |
| a quantized checkpoint (genlib.models.qformat) on a CPU (any rows) | native, its codes as stored |
| several rows otherwise, a bitsandbytes model, or any other model | transformers |
| speculation on a GPU without the lean forward | transformers |

On a GPU a step's kernel launches and casts, not its arithmetic, set the pace, which a
compiled step (torch.compile over a fixed-size cache, in inductor's default mode: no
CUDA graphs, whose fixed sizes the lean step's attention length is not) removes; its
first step compiles for seconds. In bfloat16/float16 auto keeps to the lean forward, on
a CPU and on a GPU alike, which is exact, where the compiled step is faster but sums in
its own order and flips greedy near-ties (`--backend compiled` asks for it). An explicit
backend
that cannot serve the request or the model is refused with a `ConfigError` naming what
would work, never replaced by another.

Environment: GENLAB_LEAN=0 keeps auto (and the quick start-up) off the lean forward,
GENLAB_NATIVE=0 keeps auto off the native kernel.

`--quantize 8bit` and `--quantize 4bit` on a CPU quantize a Llama-style model's matrices
for the native kernel (`NATIVE_FORMATS`, `native_quantization`: the model loads in
float32 and the kernel packs its own quantized copy); on a GPU, with `--backend
transformers`, or for another architecture, bitsandbytes quantizes it and transformers'
forward runs it.

A draft model (speculative decoding) asks for its matrices in bfloat16 where it runs on
the native kernel (`draft_request`): the target checks every proposal, so the draft's
precision moves its speed and acceptance, never the output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from genlib.backends.arch import ARCHITECTURES
from genlib.errors import ConfigError, not_one_of

if TYPE_CHECKING:
    from genlib.backends.base import Backend
    from genlib.backends.llama import LeanLlama
    from genlib.models.info import LoadedModel

BACKENDS = ("auto", "transformers", "lean", "compiled", "native")
# The native kernel's format for each --quantize on a CPU (genlib.backends.quant): 4bit
# is the faster of nf4 and q4_0 as measured (docs/performance.md); the formats by name
# run on the native kernel alone.
NATIVE_FORMATS = {"8bit": "q8_0", "4bit": "nf4", "q8_0": "q8_0", "nf4": "nf4",
                  "q4_0": "q4_0"}


@dataclass(frozen=True)
class Request:
    """What a generation needs of its backend. `rows`: rows held at once (prompts times
    outputs, or beams); `reorder`: beam search; `crop`: speculative rollback; `weights`:
    how the native kernel stores the matrices (float32 or bfloat16, `kernel.WEIGHTS`;
    None: the model's own, on any backend); `hidden`: the method that needs the lean
    forward's hidden states (which the lean backend alone gives)."""

    rows: int = 1
    reorder: bool = False
    crop: bool = False
    backend: str = "auto"
    weights: str | None = None
    hidden: str | None = None  # what needs hidden states ("contrastive search", "DoLa")

    def kernel_weights(self, lm: LoadedModel) -> str:
        """The matrices the native kernel reads for this request on `lm`: the ones
        `weights` asks for, else the model's quantized format (`lm.weights`), else the
        format its checkpoint stores (genlib.models.qformat: the codes as stored), else its
        float32 matrices."""
        return self.weights or lm.weights or stored_format(lm) or "float32"


def stored_format(lm: LoadedModel) -> str | None:
    """The quantized format `lm`'s checkpoint stores its matrices in (genlib.models.qformat);
    None for a float checkpoint."""
    stored = getattr(lm, "stored", None)
    return stored.format if stored is not None else None


# The backends that run one row per forward (no batches, no beam search).
ONE_ROW = ("lean", "compiled")
DRAFT_WEIGHTS = ("auto", "float32", "bfloat16")


def lean_allowed() -> bool:
    """False when GENLAB_LEAN=0 keeps generations (and quick loading) off the lean forward."""
    return os.environ.get("GENLAB_LEAN", "1") != "0"


def native_allowed() -> bool:
    """False when GENLAB_NATIVE=0 keeps auto off the native kernel."""
    return os.environ.get("GENLAB_NATIVE", "1") != "0"


def check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(not_one_of("--backend", name, BACKENDS))
    return name


def choose_backend(lm: LoadedModel, request: Request) -> Backend:
    """A fresh backend for one generation on `lm` (see the module doc); its `reason`
    says why it was picked."""
    name, reason = _pick(lm, request)
    backend = _build(name, lm, request.kernel_weights(lm))
    backend.reason = reason
    return backend


def backend_name(lm: LoadedModel, request: Request) -> str:
    """The name of the backend `choose_backend` gives `request`, without building it; the
    same ConfigError for an explicit backend that cannot serve it."""
    return _pick(lm, request)[0]


def native_quantization(quantize: str, device_type: str, dtype: str, backend: str,
                        llama_style: bool) -> str | None:
    """The native kernel's format (`NATIVE_FORMATS`) that runs `--quantize quantize` for a
    model loaded on `device_type` in `dtype` (a flag's value) to run on `backend`, or None
    where bitsandbytes quantizes it (a GPU, --backend transformers, another architecture,
    GENLAB_NATIVE=0). A request neither can serve is refused with a ConfigError naming
    what would."""
    if quantize == "none":
        return None
    bitsandbytes = quantize in ("8bit", "4bit")
    fits = device_type == "cpu" and dtype in ("auto", "float32") and llama_style \
        and lean_allowed()
    if backend == "native" or not bitsandbytes:
        if not fits:
            why = ("a float32 Llama-style model on the CPU" if llama_style
                   else "plain Llama-style models (llama, mistral, qwen2)")
            instead = "--quantize 8bit or 4bit with --backend transformers (bitsandbytes)"
            raise ConfigError(f"--quantize {quantize} on the native backend quantizes "
                              f"{why}; use {instead}")
        return NATIVE_FORMATS[quantize]
    if backend == "auto" and fits and native_allowed():
        return NATIVE_FORMATS[quantize]
    return None


def check_draft_weights(weights: str, draft_model: bool = True) -> str:
    """`weights` when it is one of `DRAFT_WEIGHTS`, and `auto` unless there is a
    `draft_model` whose matrices it sets; else the ConfigError that says so."""
    if weights not in DRAFT_WEIGHTS:
        raise ConfigError(not_one_of("--draft-weights", weights, DRAFT_WEIGHTS))
    if weights != "auto" and not draft_model:
        raise ConfigError(f"--draft-weights {weights} sets how the draft model's matrices "
                          f"are stored; give --draft-model too, or drop it")
    return weights


def draft_request(lm: LoadedModel, backend: str, weights: str = "auto") -> Request:
    """What a draft model needs: one row that rolls back, on `backend`, its matrices as
    `weights` (`DRAFT_WEIGHTS`) says. auto: bfloat16 where the draft runs on the native
    kernel (half its reads), the model's own elsewhere; float32 or bfloat16 ask the
    native kernel for them, and are refused where the draft runs on another backend."""
    request = Request(rows=1, crop=True, backend=backend)
    if check_draft_weights(weights) != "auto":
        asked = replace(request, weights=weights)
        name, reason = _pick(lm, asked)
        if name != "native":
            other = " or --backend native" if backend != "auto" else ""
            raise ConfigError(f"--draft-weights {weights} is how the native backend stores "
                              f"the draft's matrices, and the draft runs on {name} "
                              f"({reason}); use --draft-weights auto{other}")
        return asked
    if backend_name(lm, request) != "native" or lm.weights is not None or stored_format(lm):
        return request  # a quantized draft reads its own format
    lean = _lean(lm)
    assert lean is not None  # the native backend runs it
    bfloat16 = _kernel_missing(lean, "bfloat16") is None
    return replace(request, weights="bfloat16") if bfloat16 else request


def _pick(lm: LoadedModel, request: Request) -> tuple[str, str]:
    """The backend's name and why: auto's choice, or the one asked for, which is refused
    with a ConfigError naming what would work when it cannot serve `request` on `lm`."""
    name = check_name(request.backend)
    if request.hidden is not None:
        return _hidden(name, lm, request)
    if name == "auto":
        name, reason = _auto(lm, request)
    else:
        refusal = _refusal(name, lm, request)
        if refusal is not None:
            raise ConfigError(refusal)
        reason = "asked for with --backend"
        if lm.weights is not None or (name == "native" and stored_format(lm)):
            reason += f", weights {request.kernel_weights(lm)}"
    return name, reason


def _auto(lm: LoadedModel, request: Request) -> tuple[str, str]:
    one_row = request.rows == 1 and not request.reorder
    many = "beam search" if request.reorder else f"{request.rows} rows"
    if lm.weights is not None:
        return _quantized(lm, request)
    if lm.quantize != "none":
        return "transformers", "a bitsandbytes model runs on transformers' forward"
    if lm.device.type != "cpu" or lm.dtype != torch_float32():
        if not one_row:
            return "transformers", f"{many} in {lm.dtype_name} on {lm.device.type}"
        if lm.dtype != torch_float32():
            return _low_precision(lm)
        if _static_cache_must_crop(lm, request):
            why = "GENLAB_LEAN=0" if not lean_allowed() else _no_compiled_lean(lm)
            return "transformers", (f"speculative decoding in {lm.dtype_name} on "
                                    f"{lm.device.type} and no compiled lean step ({why}): "
                                    f"a compiled static cache cannot roll back")
        return "compiled", f"one row in {lm.dtype_name} on {lm.device.type}: a compiled step"
    if not lean_allowed():
        return "transformers", "GENLAB_LEAN=0"
    lean = _lean(lm)
    if lean is None:
        return "transformers", f"no lean forward: {lean_refusal(lm)}"
    why_not = "GENLAB_NATIVE=0" if not native_allowed() \
        else _kernel_missing(lean, request.kernel_weights(lm))
    if why_not is None and stored_format(lm) is not None:
        return "native", f"a {stored_format(lm)} checkpoint: weights {stored_format(lm)} as stored"
    if why_not is None:
        return "native", f"a float32 {lean.arch.name} model on the CPU"
    if one_row:
        return "lean", why_not if why_not == "GENLAB_NATIVE=0" else \
            f"no native kernel: {why_not}"
    return "transformers", f"{many}, and no native kernel ({why_not}): the lean forward " \
                           f"runs one row"


def _hidden(name: str, lm: LoadedModel, request: Request) -> tuple[str, str]:
    """The lean backend, the one that gives hidden states, for `request.hidden`; a
    ConfigError where it cannot run or another backend is asked for."""
    what = request.hidden
    if name not in ("auto", "lean"):
        raise ConfigError(f"the {name} backend gives no hidden states, which {what} needs; "
                          f"use --backend lean (or auto)")
    if request.rows > 1 or request.reorder:
        raise ConfigError(f"{what} runs one row: give one prompt and one output "
                          f"(num_return_sequences 1, no beams)")
    why = None
    if lm.weights is not None or lm.quantize != "none":
        why = f"--quantize {lm.quantize} (quantized matrices)"
    elif not lean_allowed():
        why = "GENLAB_LEAN=0"
    elif _lean(lm) is None:
        why = lean_refusal(lm)
    if why is not None:
        raise ConfigError(f"{what} needs the lean forward's hidden states, and it cannot "
                          f"run {lm.ref}: {why}; use an unquantized Llama-style model")
    return "lean", f"{what} needs hidden states: the lean forward"


def _quantized(lm: LoadedModel, request: Request) -> tuple[str, str]:
    """A model whose matrices the native kernel quantizes: native, the one backend that
    reads them (refused with one line where its kernel cannot run)."""
    refusal = _refusal("native", lm, request)
    if refusal is not None:
        raise ConfigError(refusal)
    return "native", f"--quantize {lm.quantize}: weights {request.kernel_weights(lm)}"


def _low_precision(lm: LoadedModel) -> tuple[str, str]:
    """One row in bfloat16/float16, on a CPU or a GPU: the lean forward, whose products
    and norms are transformers' own operations. A compiled step fuses them and sums in
    its own order, which in these dtypes moves a logit by a rounding step often enough to
    flip greedy tokens at near-ties (on a CPU and on an H100 alike: docs/performance.md)."""
    dtype, device = lm.dtype_name, lm.device.type
    if not lean_allowed():
        return "transformers", f"one row in {dtype} on {device}, GENLAB_LEAN=0"
    if _lean(lm) is None:
        return "transformers", (f"one row in {dtype} on {device}, no lean forward: "
                                f"{lean_refusal(lm)}")
    return "lean", (f"one row in {dtype} on {device}: the lean forward, exact; a compiled "
                    f"step sums in another order")


def _kernel_missing(lean: LeanLlama, weights: str) -> str | None:
    from genlib.backends import kernel

    return kernel.applies(lean, weights)


def torch_float32() -> object:
    import torch

    return torch.float32


def _lean(lm: LoadedModel) -> LeanLlama | None:
    from genlib.backends.lean import lean_model_of

    return lean_model_of(lm)


def architecture(lm: LoadedModel) -> str:
    """The model's architecture (its config's model_type), as records name it."""
    if lm.lean is not None:
        return lm.lean.arch.name
    return str(getattr(getattr(lm.model, "config", None), "model_type", None) or "unknown")


def lean_refusal(lm: LoadedModel) -> str:
    """Why `lm` has no lean forward, in one line naming the config key or the
    architecture."""
    from genlib.backends.llama import refusal

    return refusal(lm.model) or "no lean forward"


def _compiled_lean(lm: LoadedModel) -> LeanLlama | None:
    """The lean forward the compiled backend compiles; None: it compiles transformers'
    forward over a static cache (also for a sliding window, which its one graph over
    every attention length does not hold)."""
    lean = _lean(lm) if lean_allowed() else None
    return lean if lean is not None and lean.arch.uncompiled() is None else None


def _no_compiled_lean(lm: LoadedModel) -> str:
    lean = _lean(lm)
    if lean is None:
        return lean_refusal(lm)
    return lean.arch.uncompiled() or "no compiled lean step"


def _static_cache_must_crop(lm: LoadedModel, request: Request) -> bool:
    """Whether the compiled backend would compile transformers' forward over a static
    cache, which cannot roll back, for a request that rolls back (speculation)."""
    return request.crop and _compiled_lean(lm) is None


def _refusal(name: str, lm: LoadedModel, request: Request) -> str | None:
    """Why the named backend cannot serve `request` on `lm`, naming only backends that
    can; None when it can."""
    if lm.weights is not None and name != "native":
        return (f"the {name} backend does not read the native kernel's {lm.weights} "
                f"weights (--quantize {lm.quantize} on a CPU); use --backend native (or "
                f"auto), or --quantize 8bit or 4bit with --backend transformers for "
                f"bitsandbytes")
    if name == "transformers":
        return None
    if name in ONE_ROW and (request.rows > 1 or request.reorder):
        what = "beam search" if request.reorder else f"{request.rows} rows at once"
        native = "native or " if _refusal("native", lm, request) is None else ""
        return (f"the {name} backend runs one row, and this generation needs {what}; use "
                f"--backend {native}transformers (or auto)")
    if lm.quantize != "none" and lm.weights is None:
        how = " (torch.compile cannot trace bitsandbytes' layers)" if name == "compiled" else ""
        return (f"the {name} backend does not run quantized models{how}; use --backend "
                f"transformers (or auto)")
    if name == "compiled":
        if _static_cache_must_crop(lm, request):
            return ("the compiled backend over transformers' static cache cannot roll it "
                    "back, which speculative decoding needs; use --backend transformers "
                    "(or auto)")
        return None
    lean = _lean(lm)
    if lean is None:
        return (f"the {name} backend runs {', '.join(ARCHITECTURES)} models, and cannot "
                f"run {lm.ref}: {lean_refusal(lm)}; use --backend transformers (or auto)")
    why_not = _kernel_missing(lean, request.kernel_weights(lm)) if name == "native" else None
    if why_not is not None:
        instead = "lean" if request.rows == 1 and not request.reorder else "transformers"
        if lm.weights is not None:
            instead = "transformers with --quantize 8bit or 4bit (bitsandbytes)"
        return f"the native backend cannot run here: {why_not}; use --backend {instead} " \
               f"(or auto)"
    return None


def _build(name: str, lm: LoadedModel, weights: str) -> Backend:
    """The named backend over `lm`, which `_pick` found can serve the request (the
    native kernel's matrices stored as `weights`)."""
    if name == "transformers":
        from genlib.backends.transformers import TransformersBackend

        return TransformersBackend(lm)
    if name == "compiled":
        return _compiled(lm)
    lean = _lean(lm)
    assert lean is not None  # _auto picks it only then, and _refusal refused it otherwise
    if name == "lean":
        from genlib.backends.lean import LeanBackend

        return LeanBackend(lm, lean)
    return _native(lm, lean, weights)


def _native(lm: LoadedModel, lean: LeanLlama, weights: str) -> Backend:
    from genlib.backends.native import NativeBackend

    step = lean.native_step(weights)
    assert step is not None  # _refusal refused it otherwise (the kernel applies)
    return NativeBackend(lm, lean, step)


def _compiled(lm: LoadedModel) -> Backend:
    from genlib.backends.compiled import CompiledLeanBackend, CompiledStaticBackend

    lean = _compiled_lean(lm)
    if lean is not None:
        return CompiledLeanBackend(lm, lean)
    return CompiledStaticBackend(lm)
