"""The lean decode step as one native kernel (`csrc/lean_step.c`), for float32 on the CPU.

torch.compile turns `LeanLlama._static_step` into ~100 kernels, each its own OpenMP
parallel region: on code-target the thread wake-ups and barriers between them, not the
weight reads, set the pace once the memory is quiet. The C kernel runs the same
arithmetic in one parallel region with five barriers a layer (its header says where).
It is built once per machine with the system's C compiler (`$CC`, split as a shell would,
so `CC='ccache cc'` works as with make; else `cc`, as inductor needs one too), cached under
the user's cache directory by a hash of its source, flags, compiler command and CPU, and
called through ctypes, which releases the GIL. A cached library that will not load is
built again once, whatever is in its way (`Build.notice` says so).

    step = NativeStep.of(lean, threads)    # None where it does not apply (`applies` says why)
    logits = step(token_id, cache)         # (1, vocab) float32; writes the cache's next slot
    logits = step.extend(tokens, cache)    # (k, vocab): k tokens of one row, one call
    logits = step.step_rows(tokens, caches)  # (B, vocab): one token each of B rows
    drawn, forwards = step.draft_greedy(tokens, cache, gamma, banned, banned_draws)
    draft = NativeStep(lean, threads, weights="bfloat16")  # a draft model's step

Every weight is read once per call however many tokens it feeds, so verifying k drafted
tokens, or stepping B rows, costs one pass over the weights plus the tokens' arithmetic
(each token's sums run as a one-token call runs them: the same bits). The kernel reads
the weight matrices packed in panels of rows (`pack`, `pack_weights`). A model mapped
from its file (genlib.models.quickload) has them packed once and cached on disk
(`packed_weights`, genlib.backends.weightcache), mapped on later starts: the process then
holds one copy of each matrix, the packed one; the float matrices stay in the mapped
model file, unread, until the torch forward needs them (`LeanLlama.layers`, made on first
use). A model loaded by transformers keeps its float weights beside the packed copy. With
`weights="bfloat16"` the packed matrices are bfloat16 and a second build of the kernel
widens them as it reads them, the arithmetic float32: half the reads, for a draft model,
whose proposals the target checks. The quantized formats (`quant.FORMATS`) have a build
each too; a 4-bit one runs an output matrix packed in q8_0 (`quant.OUTPUT_FORMAT`, as
`--quantize` packs it and new checkpoints store it) through the q8_0 build's product
(`head_library`). `ensure_built(notify)` tells its caller before the
first build compiles (a second or two a build).

`LeanLlama.native_step` makes it; the native backend (genlib.backends.native) runs it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from genlib.backends import quant
from genlib.backends.sizes import tensor_bytes
from genlib.errors import ModelLoadError

SOURCE = Path(__file__).parent / "csrc" / "lean_step.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
BUILDING = "building genlab's native kernel"  # then the formats: `building`
# How the products store the weight matrices (torch's dtype names, or a quantized format
# of genlib.backends.quant), and the build flags that make them read so.
WEIGHTS = {"float32": (), "bfloat16": ("-DGENLAB_BF16_WEIGHTS",),
           "q8_0": ("-DGENLAB_Q8_0_WEIGHTS",), "nf4": ("-DGENLAB_NF4_WEIGHTS",),
           "q4_0": ("-DGENLAB_Q4_0_WEIGHTS",)}
PREFILL_SLOTS = 256  # tokens a prefill call feeds at most: its scratch grows with them
LAYOUT = 2  # the packed matrices' layout (`pack`): the weight cache keys on it, bump it
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# The MLP's input norm by `Arch.sandwich` (the lean forward reads it from here too).
MLP_NORM = {False: "post_attention_layernorm", True: "pre_feedforward_layernorm"}

_float_p = ctypes.POINTER(ctypes.c_float)
_float_pp = ctypes.POINTER(_float_p)


class _Model(ctypes.Structure):
    """`Model` in csrc/lean_step.c."""

    _fields_ = [(name, ctypes.c_int) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "layers",
        "threads")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (name, _float_p) for name in ("embed", "norm", "lm_head", "cos", "sin")] + [
        (name, _float_pp) for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm",
                                       "gate", "up", "down")] + [
        (name, ctypes.c_float) for name in ("embedding_multiplier", "residual_multiplier",
                                            "logits_scaling")] + [
        ("windows", ctypes.POINTER(ctypes.c_int)), ("q_norm", _float_pp),
        ("k_norm", _float_pp), ("attn_softcap", ctypes.c_float),
        ("final_softcap", ctypes.c_float), ("gelu", ctypes.c_int)] + [
        (name, _float_pp) for name in ("attn_out_norm", "mlp_out_norm", "layer_cos",
                                       "layer_sin")] + [
        ("norm_bias", _float_p)] + [
        (name, _float_pp) for name in ("input_norm_bias", "post_norm_bias", "o_bias",
                                       "up_bias", "down_bias")] + [
        ("position_embed", _float_p), ("head_matmul", ctypes.c_void_p)]

# Model.gelu: the MLP's activation, by `Arch.activation`.
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu_new": 1, "gelu": 2}


@dataclass(frozen=True)
class Build:
    """The kernel's shared library, or why there is none."""

    library: ctypes.CDLL | None
    reason: str = ""
    notice: str = ""  # worth a line on stderr: a cache rebuilt, a $CC that names nothing


def _compiler() -> tuple[str, ...] | None:
    """The compiler command: $CC split as a shell would (make takes `CC='ccache cc'` and
    `CC='cc -O2'`), else cc or gcc; None if there is none."""
    given = os.environ.get("CC", "").strip()
    if given:
        try:
            return tuple(shlex.split(given))
        except ValueError:  # unbalanced quotes: one word, which names no program
            return (given,)
    found = shutil.which("cc") or shutil.which("gcc")
    return (found,) if found else None


def _no_program(compiler: tuple[str, ...]) -> str | None:
    """Why $CC cannot run, in one line, or None when its first word is a program."""
    if shutil.which(compiler[0]) is not None:
        return None
    given = os.environ.get("CC", shlex.join(compiler))
    return (f"could not build {SOURCE.name}: CC={given!r} names no program "
            f"({compiler[0]!r} is not found), so the native kernel is off; set CC to a C "
            f"compiler, or unset it to use cc")


def _cpu_flags() -> str:
    try:  # -march=native builds for this CPU: a cache shared with another must not match
        return next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    from genlib import cachedirs

    return cachedirs.native()


@functools.cache
def _version(compiler: tuple[str, ...]) -> str:
    return subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                          timeout=30).stdout


def _library_path(compiler: tuple[str, ...], flags: tuple[str, ...], source: Path) -> Path:
    """Where the library built from `source` with `compiler` (the whole command, its
    arguments included) and `flags` for this CPU is cached: named by a hash of all four."""
    version = _version(compiler)
    key = hashlib.sha256("\0".join([source.read_text(), *compiler, version, *flags,
                                    _cpu_flags()]).encode()).hexdigest()[:24]
    return _cache_dir() / f"{source.stem}-{key}.so"


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _intact(library: Path) -> bool:
    """Whether the cached library is the file its build wrote: a truncated or foreign
    file must not reach dlopen, which maps it unchecked and could crash the process."""
    try:
        digest = _digest_file(library).read_text().strip()
        return hashlib.sha256(library.read_bytes()).hexdigest() == digest
    except OSError:
        return False


def _will_compile(flags: tuple[str, ...], source: Path = SOURCE) -> bool:
    """Whether `build` would compile: there is a compiler that runs and no intact
    library in the cache."""
    compiler = _compiler()
    if compiler is None or _no_program(compiler):
        return False
    try:
        return not _intact(_library_path(compiler, flags, source))
    except (OSError, subprocess.SubprocessError):
        return False  # no compiler that runs: build gives the reason, compiles nothing


def ensure_built(notify: Callable[[str], None] | None = None,
                 flags: tuple[str, ...] = FLAGS, weights: tuple[str, ...] = ("float32",)
                 ) -> Build:
    """`build()` of the kernels that read each of `weights` (`WEIGHTS` keys), first
    calling `notify` with `building(...)` when one is going to compile (the CLI prints
    it on stderr: a build takes a second or two); the first one's build."""
    kinds = builds_for(weights)
    compiling = [kind for kind in kinds if _will_compile(flags + WEIGHTS[kind])]
    if notify is not None and compiling:
        notify(building(compiling))
    return [build_for(kind, flags) for kind in kinds][0]


def building(kinds: Sequence[str]) -> str:
    """What the CLI says before compiling the builds for `kinds` (WEIGHTS keys)."""
    return f"{BUILDING} for {' and '.join(kinds)} weights (once per format on this machine)"


def builds_for(weights: tuple[str, ...]) -> tuple[str, ...]:
    """The builds the kernels for `weights` need: each one's own, then its output
    matrix's (`quant.output_format`) where that is another."""
    return tuple(dict.fromkeys([*weights, *map(quant.output_format, weights)]))


def build_for(weights: str, flags: tuple[str, ...] = FLAGS) -> Build:
    """`build()` of the kernel that reads its matrices as `weights` (a `WEIGHTS` key)."""
    return build(flags + WEIGHTS[weights])


@functools.cache
def build(flags: tuple[str, ...] = FLAGS, source: Path = SOURCE) -> Build:
    """Compile (or find in the cache) and load the kernel; once per process and flags.
    A cached file that is not what a build wrote (truncated, overwritten) is rebuilt;
    so, once, is one that will not load (`_reload`)."""
    compiler = _compiler()
    if compiler is None:
        return Build(None, "no C compiler found (set $CC)")
    missing = _no_program(compiler)
    if missing:
        return Build(None, missing, notice=missing)
    try:
        library = _library_path(compiler, flags, source)
        if not _intact(library):
            _compile(compiler, flags, source, library)
            return Build(_load(library, flags))
    except (OSError, subprocess.SubprocessError) as error:
        return Build(None, f"could not build {source.name} with {shlex.join(compiler)}: "
                           f"{error}")
    try:
        return Build(_load(library, flags))
    except OSError as error:
        return _reload(compiler, flags, source, library, error)


_FLAGS: dict[int, tuple[str, ...]] = {}  # a loaded build's handle -> its flags


def _load(library: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """Load a build, noting its flags (`head_library` builds its sibling from them)."""
    loaded = ctypes.CDLL(str(library))
    _FLAGS[loaded._handle] = flags
    return loaded


def _reload(compiler: tuple[str, ...], flags: tuple[str, ...], source: Path, library: Path,
            error: OSError) -> Build:
    """The cached library matches its checksum yet will not load (its bytes damaged
    since, or written by a foreign build): build it again in its place, once."""
    try:
        _compile(compiler, flags, source, library)
        return Build(_load(library, flags),
                     notice=f"the cached native kernel would not load ({error}); rebuilt it")
    except (OSError, subprocess.SubprocessError) as again:
        reason = f"could not load or rebuild the cached native kernel {library}: {again}"
        return Build(None, reason, notice=reason)


def _compile(compiler: tuple[str, ...], flags: tuple[str, ...], source: Path,
             library: Path) -> None:
    """Build `library` in a scratch folder beside it and rename it (and its checksum)
    into place, clearing the way first: a file where the cache folder should be, and
    a folder where the library or its checksum should be."""
    _clear(library.parent, keep_folder=True)
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        target = Path(scratch) / library.name  # renamed into place: readers never see half
        done = subprocess.run([*compiler, *flags, "-o", str(target), str(source), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise OSError(f"{shlex.join(compiler)} failed: {last}")
        digest = Path(scratch) / _digest_file(library).name
        digest.write_text(hashlib.sha256(target.read_bytes()).hexdigest())
        for path in (library, _digest_file(library)):
            _clear(path, keep_folder=False)
        os.replace(target, library)  # a reader between the two renames rebuilds: harmless
        os.replace(digest, _digest_file(library))


def _clear(path: Path, keep_folder: bool) -> None:
    """Remove what is at `path` if it is in the way: a folder where a file goes (unless
    `keep_folder`), or anything but a folder where a folder goes (`keep_folder`)."""
    if not os.path.lexists(path):
        return
    if keep_folder and not path.is_dir():  # a link to a folder is a folder here
        path.unlink()
    elif not keep_folder and path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)


def _pointer(tensor: torch.Tensor | None) -> _float_p:
    return ctypes.cast(tensor.data_ptr(), _float_p) if tensor is not None else _float_p()


def _pointers(tensors: list[Any]) -> Any:
    return (_float_p * len(tensors))(*[_pointer(t) for t in tensors])


def pack(weight: torch.Tensor, panel: int) -> torch.Tensor:
    """`weight` (out, in) as the kernel's products read it: panels of `panel` rows, each
    stored column by column ((in, panel) blocks), the last panel's missing rows zero. A
    copy: the kernel holds its weights beside the lean forward's."""
    rows, columns = weight.shape
    padded = -(-rows // panel) * panel
    if padded != rows:
        weight = torch.cat([weight, weight.new_zeros(padded - rows, columns)])
    return weight.reshape(padded // panel, panel, columns).transpose(1, 2).contiguous()


def pack_matrix(weight: torch.Tensor, panel: int, weights: str) -> torch.Tensor:
    """`weight` (out, in) float32 as the kernel that reads `weights` (a `WEIGHTS` key)
    reads it: float32 or bfloat16 panels (`pack`), or a quantized format's bytes
    (`quant.pack`). One tensor a matrix, a copy; pure."""
    weight = weight.contiguous()  # gpt2's are transposed views of its Conv1D weights
    if weights in quant.FORMATS:
        return quant.pack_codes(*quantize(weight, weights), panel, weights)
    return pack(weight, panel).to(getattr(torch, weights))


def quantize(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant.quantize(weight, name)`; nf4's codes and scales from the kernel's
    `genlab_nf4_quantize` where its nf4 build is at hand: the same numbers, several
    times faster (its candidate scales cost PyTorch a pass over the weights each)."""
    library = build_for("nf4").library if name == "nf4" else None
    if library is None:
        return quant.quantize(weight, name)
    quant.check_finite(weight, name)
    weight = weight.detach().to(torch.float32).contiguous()
    rows, columns = weight.shape
    codes = torch.empty(rows, columns, dtype=torch.uint8)
    scales = torch.empty(rows, -(-columns // quant.FORMATS[name].block), dtype=torch.float32)
    levels, middles = quant.nf4_tables()
    shares = torch.tensor(quant.NF4_SEARCH, dtype=torch.float32)
    library.genlab_nf4_quantize(
        _pointer(weight), ctypes.c_long(rows), ctypes.c_long(columns), _pointer(levels),
        _pointer(middles), _pointer(shares), ctypes.c_int(len(shares)),
        ctypes.c_void_p(codes.data_ptr()), _pointer(scales),
        ctypes.c_int(torch.get_num_threads()))  # --threads, as PyTorch's ops take it
    return codes, scales


def qkv_bias(tensors: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor | None:
    """Layer `prefix`'s q/k/v biases as one vector (zeros for a projection without one),
    as the fused q/k/v product adds them; None when it has none."""
    names = [prefix + name for name in QKV]
    biases = [tensors.get(name + ".bias") for name in names]
    if all(bias is None for bias in biases):
        return None
    with torch.no_grad():
        return torch.cat([bias if bias is not None else
                          tensors[name + ".weight"].new_zeros(tensors[name + ".weight"].shape[0])
                          for bias, name in zip(biases, names)])


def pack_weights(tensor: Callable[[str], Any], layers: int, head: str, panel: int,
                 weights: str, gated: bool = True, head_weights: str | None = None
                 ) -> dict[str, torch.Tensor]:
    """Every matrix the kernel reads, packed (`pack`) and stored as `weights`, by the
    names NativeStep takes: `lm_head`, `layers.{i}.qkv` (q, k and v stacked), `.o`,
    `.gate` (unless not `gated`: gpt2's MLP has none), `.up`, `.down`. `tensor(name)`
    gives a float matrix (out, in) by its state-dict name, or a quantized checkpoint's
    (codes, scales) (genlib.models.qformat), packed as stored: in format `weights`, the
    output matrix in `head_weights` (default `weights`), as for a float matrix; `head` is
    the output projection's name (the embeddings' when tied)."""
    def matrix(*names: str, stored_as: str = weights) -> torch.Tensor:
        rows = [tensor(name) for name in names]
        if isinstance(rows[0], tuple):  # stored codes and scales: rows stack as they are
            codes, scales = (torch.cat(parts) for parts in zip(*rows))
            return quant.pack_codes(codes, scales, panel, stored_as)
        try:
            return pack_matrix(torch.cat(rows) if len(rows) > 1 else rows[0], panel,
                               stored_as)
        except quant.NonFiniteWeights as error:
            bad = next(n for n, row in zip(names, rows) if not torch.isfinite(row).all())
            raise ModelLoadError(f"{bad}: {error}; the model's weights are damaged, or run "
                                 f"it without --quantize") from None

    packed = {"lm_head": matrix(head, stored_as=head_weights or weights)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        packed.update({
            f"layers.{i}.qkv": matrix(*[f"{prefix}{name}.weight" for name in QKV]),
            f"layers.{i}.o": matrix(f"{prefix}self_attn.o_proj.weight"),
            f"layers.{i}.up": matrix(f"{prefix}mlp.up_proj.weight"),
            f"layers.{i}.down": matrix(f"{prefix}mlp.down_proj.weight")})
        if gated:
            packed[f"layers.{i}.gate"] = matrix(f"{prefix}mlp.gate_proj.weight")
    return packed


def packed_weights(lean: Any, panel: int, weights: str,
                   notify: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """`pack_weights` over `lean`'s matrices: through the weight cache where they were
    mapped from a file (`lean.weights_file`, genlib.models.quickload), read from that file one
    at a time when the cache misses (so the float matrices are never all in memory);
    packed in memory from `lean.tensors` otherwise (a model loaded by transformers). A
    quantized checkpoint's matrices (`lean.stored`, genlib.models.qformat) in its own format are
    packed from its codes as stored, through the weight cache too."""
    from genlib.backends import weightcache

    head = head_format(lean, weights)

    def over(tensor: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        return pack_weights(tensor, lean.num_layers, lean.head_name, panel, weights,
                            lean.arch.gated, head)

    def keyed(file: Path) -> tuple[str, dict[str, Any]]:
        entry, key = cache_key(file, weights, panel, lean.dtype)
        return entry, key if head == weights else {**key, "head": head}

    stored = getattr(lean, "stored", None)
    if _from_codes(lean, weights):  # a quantized checkpoint's codes
        entry, key = keyed(stored.file)
        return weightcache.cached(entry, {**key, "source": "codes"},
                                  lambda: over(stored.quantized), notify)
    file = lean.weights_file
    if file is None:
        return over(lean.tensors.__getitem__)

    def from_file() -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", backend="pread") as source:
            return over(lambda name: source.get_tensor(name).to(lean.dtype))

    entry, key = keyed(Path(file))
    return weightcache.cached(entry, key, from_file, notify)


def _from_codes(lean: Any, weights: str) -> bool:
    """Whether `lean`'s matrices are a quantized checkpoint's codes in format `weights`."""
    stored = getattr(lean, "stored", None)
    return stored is not None and stored.format == weights


def head_format(lean: Any, weights: str) -> str:
    """The format the kernel reads `lean`'s output matrix in, beside its other matrices in
    `weights`: `quant.output_format` where the matrices are packed from float weights; a
    quantized checkpoint's codes in the format they are stored in."""
    if _from_codes(lean, weights):
        return str(lean.stored.format_of(lean.head_name))
    return quant.output_format(weights)


def head_library(library: ctypes.CDLL, head: str) -> ctypes.CDLL:
    """The build of the kernel that runs the output matrix's product in format `head`
    beside `library`: `library`'s own flags, its weight format swapped (so the two
    agree on the panel's rows)."""
    flags = _FLAGS.get(library._handle, FLAGS)  # type: ignore[attr-defined]
    formats = {flag for extra in WEIGHTS.values() for flag in extra}
    built = build(tuple(f for f in flags if f not in formats) + WEIGHTS[head])
    if built.library is None:
        raise ValueError(f"no {head} build of the kernel for the output matrix: "
                         f"{built.reason}")
    if built.library.genlab_panel_rows() != library.genlab_panel_rows():
        raise ValueError(f"the {head} build for the output matrix packs other panels")
    return built.library


def cache_key(file: Path, weights: str, panel: int, dtype: torch.dtype
              ) -> tuple[str, dict[str, Any]]:
    """The weight cache's entry name and key for `file`'s matrices packed as `weights`
    in panels of `panel` rows. The file is known by its path, size and mtime_ns: a stat,
    free at every start, where a hash of its contents would read all of it (a hash of
    its header alone would miss new values of the same shapes); any rewrite of the file
    changes its mtime_ns."""
    real = file.resolve()
    stat = real.stat()
    where = hashlib.sha256(str(real).encode()).hexdigest()[:12]
    entry = f"{real.parent.name}-{where}-{weights}-p{panel}"
    return entry, {"file": str(real), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                   "weights": weights, "panel": panel, "layout": LAYOUT,
                   **({"encoder": quant.ENCODERS[weights]} if weights in quant.ENCODERS
                      else {}),
                   "dtype": str(dtype).removeprefix("torch.")}


def applies(lean: Any, weights: str = "float32") -> str | None:
    """Why the kernel does not apply to `lean`, or None when it does."""
    if lean.device.type != "cpu" or lean.dtype != torch.float32:
        return "the native step runs float32 on the CPU"
    if lean.heads % lean.kv_heads or lean.head_dim % 2:
        return "unusual head layout"
    return next((build_for(kind).reason for kind in builds_for((weights,))
                 if build_for(kind).reason), None)


class NativeStep:
    """The kernel over one LeanLlama's weights: the norms and tables held by reference,
    as the lean forward holds them (they must not be replaced), the matrices packed.
    Calls on different caches may run at once from several Python threads; calls on one
    cache must not."""

    def __init__(self, lean: Any, threads: int, library: ctypes.CDLL | None = None,
                 weights: str = "float32", notify: Callable[[str], None] | None = None
                 ) -> None:
        """Over `lean`'s weights, on `threads` threads, its matrices stored as `weights`
        (a `WEIGHTS` key), with `library` (default: `build_for(weights)`'s); `notify`
        hears what the weight cache has to say (`packed_weights`)."""
        self._kept: list[torch.Tensor] = []
        self.vocab = lean.vocab
        self.threads = threads
        if weights not in WEIGHTS:
            raise ValueError(f"the kernel stores matrices as {', '.join(WEIGHTS)}, not "
                             f"{weights}")
        self.weights = weights
        library = library or build_for(weights).library
        library.genlab_weight_format.restype = ctypes.c_char_p  # type: ignore[union-attr]
        if library.genlab_weight_format().decode() != weights:  # type: ignore[union-attr]
            raise ValueError(f"this build of the kernel does not read {weights} matrices")
        panel = library.genlab_panel_rows()  # type: ignore[union-attr]
        packed = packed_weights(lean, panel, weights, notify)
        self._kept.extend(packed.values())
        # What a step reads (genlib.backends.sizes): the packed matrices; of the float
        # embedding tables one row each, and the norms and biases (a few kB), left out.
        self.weight_bytes = tensor_bytes(packed.values())
        head = head_format(lean, weights)
        self.head_weights = head
        self._head_library = head_library(library, head) if head != weights else None
        layer = [f"layers.{i}." for i in range(lean.num_layers)]
        mlp_norm = MLP_NORM[lean.arch.sandwich]
        self._step = library.genlab_step  # type: ignore[union-attr]
        self._step.restype = None
        self._scratch_floats = library.genlab_scratch_floats  # type: ignore[union-attr]
        self._scratch_floats.restype = ctypes.c_long
        self._forward = library.genlab_forward  # type: ignore[union-attr]
        self._forward.restype = None
        self._forward_floats = library.genlab_forward_scratch_floats  # type: ignore[union-attr]
        self._forward_floats.restype = ctypes.c_long
        self._draft = library.genlab_draft_greedy  # type: ignore[union-attr]
        self._draft.restype = ctypes.c_int
        self.tokens = lean.embed.shape[0]
        self.model = _Model(
            hidden=lean.embed.shape[1], heads=lean.heads, kv_heads=lean.kv_heads,
            head_dim=lean.head_dim, intermediate=lean.intermediate,
            vocab=self.vocab, layers=lean.num_layers, threads=threads, eps=lean.eps,
            scale=lean.scale, embed=_pointer(self._keep(lean.embed.contiguous())),
            norm=_pointer(self._keep(lean.norm)), lm_head=_pointer(packed["lm_head"]),
            cos=self._table(lean.cos), sin=self._table(lean.sin),
            input_norm=self._array([lean.norm_weight(f"model.{p}input_layernorm.weight")
                                    for p in layer]),
            qkv=self._array([packed[p + "qkv"] for p in layer]),
            qkv_bias=self._array([qkv_bias(lean.tensors, f"model.{p}") for p in layer]),
            o=self._array([packed[p + "o"] for p in layer]),
            post_norm=self._array([lean.norm_weight(f"model.{p}{mlp_norm}.weight")
                                   for p in layer]),
            gate=self._array([packed[p + "gate"] for p in layer]) if lean.arch.gated
            else None,
            up=self._array([packed[p + "up"] for p in layer]),
            down=self._array([packed[p + "down"] for p in layer]),
            head_matmul=ctypes.cast(self._head_library.genlab_matmul, ctypes.c_void_p).value
            if self._head_library is not None else None,
            **self._arch_fields(lean, layer))

    def _arch_fields(self, lean: Any, layer: list[str]) -> dict[str, Any]:
        """The Model fields of `lean.arch`'s differences from Llama's block, read from
        `lean.tensors` (`layer`: each layer's name prefix, after `model.`)."""
        arch = lean.arch

        def norms(name: str) -> Any:
            names = [f"model.{p}{name}.weight" for p in layer]
            if names[0] not in lean.tensors:
                return None
            return self._array([lean.norm_weight(name) for name in names])

        windows = (ctypes.c_int * lean.num_layers)(*[arch.window_of(i)
                                                     for i in range(lean.num_layers)])
        self._kept.append(windows)  # type: ignore[arg-type]
        tables = [lean.rope_tables(i) for i in range(lean.num_layers)]
        rope = lean.cos is not None  # gpt2's learned positions: no tables
        multiplier = arch.embedding_multiplier if arch.embed_scale is None else \
            arch.embed_scale  # float32 in the struct, as gemma rounds it to float32
        return dict(embedding_multiplier=multiplier,
                    residual_multiplier=arch.residual_multiplier,
                    logits_scaling=arch.logits_scaling, windows=windows,
                    q_norm=norms("self_attn.q_norm"), k_norm=norms("self_attn.k_norm"),
                    attn_softcap=arch.attn_softcap or 0.0,
                    final_softcap=arch.final_softcap or 0.0,
                    gelu=_ACTIVATIONS[arch.activation],
                    attn_out_norm=norms("post_attention_layernorm") if arch.sandwich else None,
                    mlp_out_norm=norms("post_feedforward_layernorm") if arch.sandwich else None,
                    layer_cos=self._array([c.contiguous() for c, _ in tables]) if rope else None,
                    layer_sin=self._array([s.contiguous() for _, s in tables]) if rope else None,
                    **self._gpt2_fields(lean, layer))

    def _gpt2_fields(self, lean: Any, layer: list[str]) -> dict[str, Any]:
        """gpt2's Model fields: its LayerNorms' biases, the o/up/down products' biases and
        its learned position embeddings (NULL where the model has none)."""
        def biases(name: str) -> Any:
            names = [f"model.{p}{name}.bias" for p in layer]
            return self._array([lean.tensors[n] for n in names]) \
                if names[0] in lean.tensors else None

        def vector(tensor: torch.Tensor | None) -> Any:
            return None if tensor is None else _pointer(self._keep(tensor.contiguous()))

        return dict(norm_bias=vector(lean.norm_bias),
                    input_norm_bias=biases("input_layernorm"),
                    post_norm_bias=biases("post_attention_layernorm"),
                    o_bias=biases("self_attn.o_proj"), up_bias=biases("mlp.up_proj"),
                    down_bias=biases("mlp.down_proj"),
                    position_embed=vector(lean.position_embed))

    def _table(self, table: torch.Tensor | None) -> Any:
        """A rope table as the kernel reads it; NULL for learned positions."""
        return None if table is None else _pointer(self._keep(table.contiguous()))

    @classmethod
    def of(cls, lean: Any, threads: int, weights: str = "float32",
           notify: Callable[[str], None] | None = None) -> NativeStep | None:
        if applies(lean, weights) is not None:
            return None
        return cls(lean, threads, weights=weights, notify=notify)

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        self._kept.append(tensor)
        return tensor

    def _array(self, tensors: list[torch.Tensor | None]) -> Any:
        self._kept.extend(t for t in tensors if t is not None)
        array = _pointers(tensors)
        self._kept.append(array)  # type: ignore[arg-type]
        return array

    def _kv(self, cache: Any) -> _CacheView:
        """The cache's KV pointers as the kernel takes them, made on the cache's first
        call through this step (its buffers are never replaced)."""
        if cache.native is None or cache.native.step is not self:
            cache.native = _CacheView(self, _pointers(cache.keys), _pointers(cache.values))
        return cache.native

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        # The kernel indexes the embeddings unchecked.
        for token in tokens:
            if not 0 <= token < self.tokens:
                raise ValueError(f"token {token} is outside the model's {self.tokens} "
                                 "embeddings")

    @staticmethod
    def _check_room(cache: Any, new: int) -> None:
        # The kernel writes the KV slots unchecked.
        if cache.length + new > cache.capacity:
            raise ValueError(f"{cache.length + new} tokens exceed the KV buffers' "
                             f"{cache.capacity}")

    def __call__(self, token: int, cache: Any) -> torch.Tensor:
        """Feed `token` after the cache's `length` tokens; its logits (1, vocab). The
        cache's length is the caller's to advance."""
        self._check_tokens([token])
        self._check_room(cache, 1)
        view = self._kv(cache)
        if view.scratch is None:  # sized for this step's threads and the cache's capacity
            view.scratch = torch.empty(self._scratch_floats(ctypes.byref(self.model),
                                                            cache.capacity))
        logits = torch.empty(1, self.vocab, dtype=torch.float32)
        self._step(ctypes.byref(self.model), ctypes.c_long(token), ctypes.c_long(cache.length),
                   view.keys, view.values, ctypes.c_long(cache.capacity),
                   _pointer(view.scratch), _pointer(logits))
        return logits

    def extend(self, tokens: Sequence[int], cache: Any, all_logits: bool = True
               ) -> torch.Tensor:
        """Feed k tokens of one row after the cache's `length` tokens in one call, each
        attending to the cached ones and to those before it (verifying k drafted tokens;
        a prompt from position 0, whole or in chunks); advances `cache.length` by k.
        The logits of all k, (k, vocab) float32, or of the last alone, (1, vocab), when
        not `all_logits`. Each row's bits are those of k one-token calls."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("extend takes at least one token")
        self._check_tokens(tokens)
        self._check_room(cache, len(tokens))
        k = len(tokens)
        logits = self._run(tokens, [cache] * k, range(cache.length, cache.length + k),
                           picks=range(k) if all_logits else [k - 1])
        cache.length += k
        return logits

    def prefill_rows(self, rows: Sequence[Sequence[int]], caches: Sequence[Any]
                     ) -> torch.Tensor:
        """Feed each row's tokens after its own cache's `length` tokens (prompts: rows of
        any lengths, no padding), all rows in calls of at most PREFILL_SLOTS tokens, so
        each weight is read once a call for every row; advances each cache's length by
        its row's length. The logits of each row's last token, (B, vocab) float32: the
        bits of one-token calls, whatever the other rows or where a call's cut falls."""
        rows, caches = [list(row) for row in rows], list(caches)
        if len(rows) != len(caches) or len({id(cache) for cache in caches}) != len(caches):
            raise ValueError("prefill_rows takes one row per cache, each cache once")
        if not all(rows):
            raise ValueError("every row of a prefill needs at least one token")
        for row, cache in zip(rows, caches):
            self._check_tokens(row)
            self._check_room(cache, len(row))
        slots = [(b, position) for b, row in enumerate(rows)
                 for position in range(caches[b].length, caches[b].length + len(row))]
        logits = torch.empty(len(rows), self.vocab, dtype=torch.float32)
        for start in range(0, len(slots), PREFILL_SLOTS):
            chunk = slots[start:start + PREFILL_SLOTS]
            tokens = [rows[b][p - caches[b].length] for b, p in chunk]
            ends = [s for s, (b, p) in enumerate(chunk)
                    if p == caches[b].length + len(rows[b]) - 1]
            out = self._run(tokens, [caches[b] for b, _ in chunk], [p for _, p in chunk],
                            picks=ends)
            logits[[chunk[s][0] for s in ends]] = out
        for row, cache in zip(rows, caches):
            cache.length += len(row)
        return logits

    def step_rows(self, tokens: Sequence[int], caches: Sequence[Any]) -> torch.Tensor:
        """Feed one token to each of B rows, row b's `tokens[b]` after its own cache's
        `length` tokens, in one call (rows of any lengths, no padding); advances each
        cache's length by one. Their logits, (B, vocab) float32, row b's the bits of a
        one-token call on its cache. The caches must be distinct."""
        tokens, caches = list(tokens), list(caches)
        if len(tokens) != len(caches) or not tokens:
            raise ValueError(f"step_rows takes one token per cache, at least one: "
                             f"{len(tokens)} tokens for {len(caches)} caches")
        if len({id(cache) for cache in caches}) != len(caches):
            raise ValueError("step_rows takes each cache once (a row's tokens in one call "
                             "are an extend)")
        self._check_tokens(tokens)
        for cache in caches:
            self._check_room(cache, 1)
        logits = self._run(tokens, caches, [cache.length for cache in caches],
                           picks=range(len(tokens)))
        for cache in caches:
            cache.length += 1
        return logits

    def draft_greedy(self, tokens: Sequence[int], cache: Any, gamma: int,
                     banned: Sequence[int] = (), banned_draws: int = 0
                     ) -> tuple[list[int], int]:
        """A greedy draft of one row in one call: feed `tokens` after the cache's `length`
        tokens, then up to `gamma` times take the argmax of the last logits and feed it
        (all but the last), `banned` ids excluded at the first `banned_draws` draws; a
        position where nothing is left (every logit -inf, or any NaN) ends the draft.
        The draws, and the forwards run (the cache's length grows by the tokens they
        fed: all of `tokens`, and the draws but the last). Each draw is torch's argmax
        of what `extend` would give at its position."""
        tokens = list(tokens)
        if not tokens or gamma < 1:
            raise ValueError("a draft feeds at least one token and draws at least one")
        if self.vocab > self.tokens:  # the kernel feeds each draw back unchecked
            raise ValueError(f"a whole draft feeds its draws back, and {self.vocab} output "
                             f"ids exceed the model's {self.tokens} embeddings")
        self._check_tokens(tokens)
        for token in banned:  # they index the logits
            if not 0 <= token < self.vocab:
                raise ValueError(f"banned id {token} is outside the model's {self.vocab} "
                                 "output ids")
        self._check_room(cache, len(tokens) + gamma - 1)
        view = self._kv(cache)
        longs = ctypes.c_long
        scratch = torch.empty(self._forward_floats(ctypes.byref(self.model), len(tokens),
                                                   cache.capacity))
        logits = torch.empty(self.vocab, dtype=torch.float32)
        drawn, forwards = (longs * gamma)(), ctypes.c_int()
        count = self._draft(ctypes.byref(self.model), ctypes.c_int(len(tokens)),
                            (longs * len(tokens))(*tokens), longs(cache.length), view.keys,
                            view.values, longs(cache.capacity), ctypes.c_int(gamma),
                            ctypes.c_int(len(banned)), (longs * max(len(banned), 1))(*banned),
                            ctypes.c_int(banned_draws), _pointer(scratch), _pointer(logits),
                            drawn, ctypes.byref(forwards))
        cache.length += len(tokens) + forwards.value - 1
        return list(drawn[:count]), forwards.value

    def _run(self, tokens: list[int], caches: list[Any], positions: Sequence[int],
             picks: Sequence[int]) -> torch.Tensor:
        """genlab_forward over slots (tokens[s] at positions[s] of caches[s]); the logits
        of the slots in `picks`, in that order."""
        n, picks = len(tokens), list(picks)
        views = [self._kv(cache) for cache in caches]
        longs = ctypes.c_long * n
        capacities = [cache.capacity for cache in caches]
        # Per call, not per cache: its size follows n; the allocator reuses the memory.
        scratch = torch.empty(self._forward_floats(ctypes.byref(self.model), n,
                                                   max(capacities)))
        logits = torch.empty(len(picks), self.vocab, dtype=torch.float32)
        self._forward(ctypes.byref(self.model), ctypes.c_int(n), longs(*tokens),
                      longs(*positions), (_float_pp * n)(*[v.keys_p for v in views]),
                      (_float_pp * n)(*[v.values_p for v in views]), longs(*capacities),
                      ctypes.c_int(len(picks)), (ctypes.c_int * len(picks))(*picks),
                      _pointer(scratch), _pointer(logits))
        return logits


class _CacheView:
    """What a NativeStep keeps on a LeanCache (`cache.native`): the pointers to its KV
    buffers, and the one-token step's scratch, sized for that step's threads."""

    def __init__(self, step: NativeStep, keys: Any, values: Any) -> None:
        self.step, self.keys, self.values = step, keys, values
        self.keys_p = ctypes.cast(keys, _float_pp)
        self.values_p = ctypes.cast(values, _float_pp)
        self.scratch: torch.Tensor | None = None
