"""Which backend runs a generation. Each backend class answers for itself
(`Backend.supports`: why it cannot serve a request; `Backend.passed_over`: why auto
leaves it to a later one); this module asks them in auto's order (`order()`), takes the
user's `--backend`, and refuses one that cannot serve with its own answer and the names
of the backends that can (`serving`).

So `auto` picks the fastest backend that is exact for the request (greedy and beam search
token-identical to transformers' `generate()`):

| request and model | auto picks |
| --- | --- |
| a float32 Llama-style model (arch.ARCHITECTURES) on a CPU with a compiler | native |
| one row of such a model otherwise (no compiler, GENLAB_NATIVE=0) | lean |
| one row of a Llama-style model in bfloat16/float16, on a CPU or a GPU | lean |
| one row of an unquantized float32 model on a GPU | compiled (lean: a sliding window) |
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

from dataclasses import replace
from typing import TYPE_CHECKING

from genlib.backends.fit import (
    Request,
    lean_allowed,
    lean_of,
    lean_refusal,
    native_allowed,
    stored_format,
    weights_named,
)
from genlib.errors import ConfigError, not_one_of

if TYPE_CHECKING:
    from genlib.backends.base import Backend
    from genlib.models.info import LoadedModel

__all__ = ["BACKENDS", "NATIVE_FORMATS", "ONE_ROW", "Request", "architecture", "backend_name",
           "check_draft_weights", "check_name", "choose_backend", "draft_request",
           "lean_allowed", "lean_refusal", "native_allowed", "native_quantization",
           "serving", "stored_format"]

BACKENDS = ("auto", "transformers", "lean", "compiled", "native")
# The native kernel's format for each --quantize on a CPU (genlib.backends.quant): 4bit
# is the faster of nf4 and q4_0 as measured (docs/performance.md); the formats by name
# run on the native kernel alone.
NATIVE_FORMATS = {"8bit": "q8_0", "4bit": "nf4", "q8_0": "q8_0", "nf4": "nf4",
                  "q4_0": "q4_0"}
DRAFT_WEIGHTS = ("auto", "float32", "bfloat16")
ONE_ROW = ("lean", "compiled")  # the backends whose `supports` refuses several rows


def order() -> tuple[type[Backend], ...]:
    """The backends in auto's order of preference: auto takes the first that serves a
    request and is not passed over (`Backend.supports`, `Backend.passed_over`). The
    compiled step comes after the lean forward: auto takes it on a GPU in float32
    alone, where the lean forward passes itself over for it."""
    from genlib.backends.compiled import CompiledBackend
    from genlib.backends.lean import LeanBackend
    from genlib.backends.native import NativeBackend
    from genlib.backends.transformers import TransformersBackend

    return (NativeBackend, LeanBackend, CompiledBackend, TransformersBackend)


def check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(not_one_of("--backend", name, BACKENDS))
    return name


def choose_backend(lm: LoadedModel, request: Request) -> Backend:
    """A fresh backend for one generation on `lm` (see the module doc); its `reason`
    says why it was picked."""
    kind, reason = _pick(lm, request)
    backend = kind.build(lm, request)
    backend.reason = reason
    return backend


def backend_name(lm: LoadedModel, request: Request) -> str:
    """The name of the backend `choose_backend` gives `request`, without building it; the
    same ConfigError for an explicit backend that cannot serve it."""
    return _pick(lm, request)[0].name


def serving(lm: LoadedModel, request: Request) -> list[str]:
    """The names of the backends that can serve `request` on `lm`, fastest first."""
    return [kind.name for kind in order() if kind.supports(lm, request) is None]


def _pick(lm: LoadedModel, request: Request) -> tuple[type[Backend], str]:
    """The backend and why: auto's choice, or the one asked for, which is refused with a
    ConfigError naming the backends that would serve when it cannot serve `request`."""
    name = check_name(request.backend)
    if name == "auto":
        return _auto(lm, request)
    [kind] = [kind for kind in order() if kind.name == name]
    refusal = kind.supports(lm, request)
    if refusal is not None:
        raise ConfigError(_refused(refusal, lm, request))
    reason = "asked for with --backend"
    if lm.weights is not None or (name == "native" and stored_format(lm)):
        reason += f", weights {weights_named(lm, request.kernel_weights(lm))}"
    return kind, reason


def _auto(lm: LoadedModel, request: Request) -> tuple[type[Backend], str]:
    """The first backend in `order()` that serves `request` and is not passed over; the
    reason names what it is good for here and the answer of a backend before it
    (`_why_not_earlier`)."""
    answers: dict[str, str] = {}
    refused: list[str] = []
    for kind in order():
        refusal = kind.supports(lm, request)
        if refusal is not None:
            answers[kind.name] = refusal
            refused.append(refusal)
            continue
        passed = kind.passed_over(lm, request)
        if passed is None:
            return kind, "; ".join([kind.picked(lm, request),
                                    *_why_not_earlier(list(answers.values()), refused)])
        answers[kind.name] = passed
    raise ConfigError(_nothing_serves(answers, request))


def _why_not_earlier(answers: list[str], refused: list[str]) -> list[str]:
    """The one answer of the backends auto left that says most: an environment switch
    the user set, else the first refusal (what this model or machine lacks), else the
    first backend passed over."""
    switches = [answer for answer in answers if answer.startswith("GENLAB_")]
    return (switches or refused or answers)[:1]


def _refused(refusal: str, lm: LoadedModel, request: Request) -> str:
    """A refusal of an explicit --backend, naming the backends that would serve."""
    others = [name for name in serving(lm, request) if name != request.backend]
    if not others:
        return f"{refusal}; no backend serves this generation here"
    return f"{refusal}; use --backend {' or '.join(others)} (or auto)"


def _nothing_serves(answers: dict[str, str], request: Request) -> str:
    """Why auto found no backend: the answer of the one backend that gives what the
    request needs (the lean forward's hidden states; the native kernel's quantized
    matrices)."""
    if request.hidden is None:
        return answers["native"]
    lean = answers["lean"]
    if lean.startswith(request.hidden):  # it says what the method needs already
        return lean
    return f"{request.hidden} needs the lean forward's hidden states, and {lean}"


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
        kind, reason = _pick(lm, asked)
        name = kind.name
        if name != "native":
            other = " or --backend native" if backend != "auto" else ""
            raise ConfigError(f"--draft-weights {weights} is how the native backend stores "
                              f"the draft's matrices, and the draft runs on {name} "
                              f"({reason}); use --draft-weights auto{other}")
        return asked
    if backend_name(lm, request) != "native" or lm.weights is not None or stored_format(lm):
        return request  # a quantized draft reads its own format
    from genlib.backends.kernel import applies

    lean = lean_of(lm)
    assert lean is not None  # the native backend runs it
    bfloat16 = applies(lean, "bfloat16") is None
    return replace(request, weights="bfloat16") if bfloat16 else request


def architecture(lm: LoadedModel) -> str:
    """The model's architecture (its config's model_type), as records name it."""
    if lm.lean is not None:
        return lm.lean.arch.name
    return str(getattr(getattr(lm.model, "config", None), "model_type", None) or "unknown")
