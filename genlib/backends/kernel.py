"""The lean decode step as one native kernel (`csrc/lean_step.c`), for float32 on the CPU.

torch.compile turns `LeanLlama._static_step` into ~100 kernels, each its own OpenMP
parallel region: on code-target the thread wake-ups and barriers between them, not the
weight reads, set the pace once the memory is quiet. The C kernel runs the same
arithmetic in one parallel region with five barriers a layer (its header says where).
It is built once per machine with the system's C compiler (`$CC`, else `cc`, as inductor
needs one too), cached under the user's cache directory by a hash of its source, flags,
compiler and CPU, and called through ctypes, which releases the GIL.

    step = NativeStep.of(lean, threads)    # None where it does not apply (`applies` says why)
    logits = step(token_id, cache)         # (1, vocab) float32; writes the cache's next slot

`LeanLlama.compiled_step` uses it where it applies and torch.compile's step elsewhere.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).parent / "csrc" / "lean_step.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")

_float_p = ctypes.POINTER(ctypes.c_float)
_float_pp = ctypes.POINTER(_float_p)


class _Model(ctypes.Structure):
    """`Model` in csrc/lean_step.c."""

    _fields_ = [(name, ctypes.c_int) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "layers",
        "threads")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (name, _float_p) for name in ("embed", "norm", "lm_head", "cos", "sin")] + [
        (name, _float_pp) for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm",
                                       "gate_up", "down")]


@dataclass(frozen=True)
class Build:
    """The kernel's shared library, or why there is none."""

    library: ctypes.CDLL | None
    reason: str = ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:  # -march=native builds for this CPU: a cache shared with another must not match
        return next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("genlab")) / "native"


@functools.cache
def build(flags: tuple[str, ...] = FLAGS) -> Build:
    """Compile (or find in the cache) and load the kernel; once per process and flags."""
    compiler = _compiler()
    if compiler is None:
        return Build(None, "no C compiler found (set $CC)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, *flags,
                                        _cpu_flags()]).encode()).hexdigest()[:24]
        library = _cache_dir() / f"lean_step-{key}.so"
        if not library.exists():
            _compile(compiler, flags, library)
        return Build(ctypes.CDLL(str(library)))
    except (OSError, subprocess.SubprocessError) as error:
        return Build(None, f"could not build {SOURCE.name}: {error}")


def _compile(compiler: str, flags: tuple[str, ...], library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        target = Path(scratch) / library.name  # renamed into place: readers never see half
        done = subprocess.run([compiler, *flags, "-o", str(target), str(SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise OSError(f"{compiler} failed: {last}")
        os.replace(target, library)


def _pointer(tensor: torch.Tensor | None) -> _float_p:
    return ctypes.cast(tensor.data_ptr(), _float_p) if tensor is not None else _float_p()


def _pointers(tensors: list[Any]) -> Any:
    return (_float_p * len(tensors))(*[_pointer(t) for t in tensors])


def applies(lean: Any) -> str | None:
    """Why the kernel does not apply to `lean`, or None when it does."""
    if lean.device.type != "cpu" or lean.dtype != torch.float32:
        return "the native step runs float32 on the CPU"
    if lean.heads % lean.kv_heads or lean.head_dim % 2:
        return "unusual head layout"
    return build().reason or None


class NativeStep:
    """The kernel over one LeanLlama's weights (held by reference, as the lean forward
    holds them: they must not be replaced)."""

    def __init__(self, lean: Any, threads: int, library: ctypes.CDLL | None = None) -> None:
        """Over `lean`'s weights, on `threads` threads, with `library` (default: `build()`'s)."""
        def matrix(w: torch.Tensor) -> torch.Tensor:
            return self._keep(w.t().contiguous())  # (out, in): a view of nn.Linear's weight

        layers = lean.layers
        self._kept: list[torch.Tensor] = []
        self.vocab = lean.lm_head.w.shape[1]
        self.threads = threads
        library = library or build().library
        self._function = library.genlab_step  # type: ignore[union-attr]
        self._function.restype = None
        self._scratch_floats = library.genlab_scratch_floats  # type: ignore[union-attr]
        self._scratch_floats.restype = ctypes.c_long
        self.tokens = lean.embed.shape[0]
        self.model = _Model(
            hidden=lean.embed.shape[1], heads=lean.heads, kv_heads=lean.kv_heads,
            head_dim=lean.head_dim, intermediate=layers[0].down.w.shape[0],
            vocab=self.vocab, layers=len(layers), threads=threads, eps=lean.eps,
            scale=lean.scale, embed=_pointer(self._keep(lean.embed.contiguous())),
            norm=_pointer(lean.norm), lm_head=_pointer(matrix(lean.lm_head.w)),
            cos=_pointer(self._keep(lean.cos.contiguous())),
            sin=_pointer(self._keep(lean.sin.contiguous())),
            input_norm=self._array([la.input_norm for la in layers]),
            qkv=self._array([matrix(la.qkv.w) for la in layers]),
            qkv_bias=self._array([la.qkv_bias for la in layers]),
            o=self._array([matrix(la.o.w) for la in layers]),
            post_norm=self._array([la.post_norm for la in layers]),
            gate_up=self._array([matrix(la.gate_up.w) for la in layers]),
            down=self._array([matrix(la.down.w) for la in layers]))

    @classmethod
    def of(cls, lean: Any, threads: int) -> NativeStep | None:
        return cls(lean, threads) if applies(lean) is None else None

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        self._kept.append(tensor)
        return tensor

    def _array(self, tensors: list[torch.Tensor | None]) -> Any:
        self._kept.extend(t for t in tensors if t is not None)
        array = _pointers(tensors)
        self._kept.append(array)  # type: ignore[arg-type]
        return array

    def _buffers(self, cache: Any) -> tuple[Any, Any, torch.Tensor]:
        """The cache's KV pointers and a scratch buffer sized for this step's threads,
        made on the cache's first step through it."""
        if cache.native is None or cache.native[0] is not self:
            floats = self._scratch_floats(ctypes.byref(self.model), cache.capacity)
            cache.native = (self, _pointers(cache.keys), _pointers(cache.values),
                            torch.empty(floats, dtype=torch.float32))
        return cache.native[1:]

    def __call__(self, token: int, cache: Any) -> torch.Tensor:
        """Feed `token` after the cache's `length` tokens; its logits (1, vocab). The
        cache's length is the caller's to advance."""
        # The kernel indexes the embeddings and writes the KV slot unchecked.
        if not 0 <= token < self.tokens:
            raise ValueError(f"token {token} is outside the model's {self.tokens} embeddings")
        if cache.length >= cache.capacity:
            raise ValueError(f"{cache.length + 1} tokens exceed the KV buffers' "
                             f"{cache.capacity}")
        keys, values, scratch = self._buffers(cache)
        logits = torch.empty(1, self.vocab, dtype=torch.float32)
        self._function(ctypes.byref(self.model), ctypes.c_long(token),
                       ctypes.c_long(cache.length), keys, values,
                       ctypes.c_long(cache.capacity), _pointer(scratch), _pointer(logits))
        return logits
