"""genlab's quantized checkpoint: a model folder whose weight matrices are stored in a
format of genlib.backends.quant (q8_0, nf4, q4_0), read here.

The folder is an ordinary Hugging Face folder (config.json, tokenizer files,
generation_config.json) whose `model.safetensors` holds, for each quantized matrix
`NAME` (`model.layers.0.self_attn.q_proj.weight`, the embeddings, `lm_head.weight`):

- `NAME.qcodes`: `quant.quantize`'s codes, (out, in) int8 for q8_0; for the 4-bit
  formats two codes a byte, (out, in / 2) uint8, column 2j in the low nibble and 2j + 1
  in the high one;
- `NAME.qscales`: its scales, (out, blocks) float16 (float32 is read too). The kernel
  and the dequantized weights both use the float16 value widened to float32, so the
  native kernel and a float forward over `dequantized` run the same weights.

Every other tensor (the norms) is stored as it was. config.json says so:

    "quantization_config": {"quant_method": "genlab", "format": "nf4", "block": 64,
                            "modules": ["model.embed_tokens", "model.layers.0...", ...],
                            "module_formats": {"model.embed_tokens": "q8_0"}}

`module_formats` (optional) names the modules stored in another format than `format`:
the output matrix of a 4-bit checkpoint (`quant.output_format`), in q8_0.

transformers does not know the method (it warns and would read the folder's tensors
raw), so genlab never hands it the folder's weights: `Stored.state_dict` dequantizes
them to float32 for the transformers and lean forwards, and the native kernel packs the
codes as stored (`Stored.quantized`).

    stored = open_folder(path)      # None: not a genlab checkpoint; ModelLoadError: broken
    codes, scales = stored.quantized("model.layers.0.mlp.up_proj.weight")
    weights = stored.dequantized_tensors(torch.float32)  # a lazy mapping, by name
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genlib.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

METHOD = "genlab"
WEIGHTS = "model.safetensors"
CODES, SCALES = ".qcodes", ".qscales"
SCALE_DTYPES = ("float16", "float32")
CODE_DTYPES = {"q8_0": "int8", "nf4": "uint8", "q4_0": "uint8"}
REWRITE = "write it again with scripts/quantize_model.py from the float model"
# The output matrix's module: its own, else the embeddings it is tied to (llama's, gpt2's).
OUTPUT_MODULES = ("lm_head", "model.embed_tokens", "transformer.wte")


def quantization_of(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """config.json's `quantization_config` when it is genlab's; None otherwise."""
    found = config.get("quantization_config")
    if isinstance(found, dict) and found.get("quant_method") == METHOD:
        return found
    return None


def float_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json without its quantization: the float model the weights dequantize to."""
    return {key: value for key, value in config.items() if key != "quantization_config"}


@dataclass(frozen=True)
class Stored:
    """A genlab quantized checkpoint whose config and tensor table were checked
    (`open_folder`): its format, the modules in it, the weights file."""

    folder: Path
    format: str
    modules: tuple[str, ...]
    plain: tuple[str, ...]  # the tensors stored as they are (norms, biases)
    config: dict[str, Any] = field(hash=False, compare=False)  # config.json, as it is
    # Every tensor of the float model, by its state-dict name: its shape.
    shapes: dict[str, tuple[int, ...]] = field(hash=False, compare=False, default_factory=dict)
    # The modules stored in another format than `format` (the output matrix).
    module_formats: dict[str, str] = field(hash=False, compare=False, default_factory=dict)

    def matrix(self, name: str) -> str:
        """The stored matrix `name` (a state-dict name) is: itself, or for a tied output
        head (`lm_head.weight` where transformers' model names one) the embeddings'."""
        if name == "lm_head.weight" and "lm_head" not in self.modules \
                and self.config.get("tie_word_embeddings"):
            return "model.embed_tokens.weight"
        return name

    def format_of(self, name: str) -> str:
        """The format matrix `name` (a state-dict name) is stored in."""
        module = self.matrix(name).removesuffix(".weight")
        return self.module_formats.get(module, self.format)

    @property
    def file(self) -> Path:
        return self.folder / WEIGHTS

    @property
    def float_config(self) -> dict[str, Any]:
        return float_config(self.config)

    def quantized(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Matrix `name`'s codes (out, in), one a byte as `quant.quantize` gives them, and
        its scales as stored (float16); a tied output head's are the embeddings'
        (`matrix`)."""
        name = self.matrix(name)
        codes, scales = self.read(name + CODES), self.read(name + SCALES)
        return (unpack_nibbles(codes) if _bits(self.format_of(name)) == 4 else codes), scales

    def dequantized(self, name: str) -> torch.Tensor:
        """Matrix `name` as the float32 weights its codes and scales stand for."""
        from genlib.backends import quant

        return quant.dequantize(*self.quantized(name), self.format_of(name))

    def dequantized_tensors(self, dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
        """Every tensor of the float model by its state-dict name, in `dtype`; a matrix
        is dequantized on its first read (the native kernel never reads most)."""
        return _Dequantized(self, dtype)

    def state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The whole float model's tensors, in `dtype` (for transformers' model)."""
        tensors = self.dequantized_tensors(dtype)
        return {name: tensors[name] for name in tensors}

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` as the file stores it."""
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as source:
            return source.get_tensor(name)


class _Dequantized(Mapping[str, "torch.Tensor"]):
    """A Stored checkpoint's float tensors by name, each read (and dequantized) once."""

    def __init__(self, stored: Stored, dtype: torch.dtype) -> None:
        self._stored, self._dtype = stored, dtype
        matrices = [module + ".weight" for module in stored.modules]
        self._names = sorted([*matrices, *stored.plain])
        self._matrices = set(matrices)
        self._done: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._done:
            if name in self._matrices:
                tensor = self._stored.dequantized(name)
            elif name in self._names:
                tensor = self._stored.read(name)
            else:
                raise KeyError(name)
            self._done[name] = tensor.to(self._dtype)
        return self._done[name]

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _bits(name: str) -> int:
    from genlib.backends import quant

    return quant.format_of(name).bits


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (out, in), in even, as stored: (out, in / 2) uint8, column 2j low."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles`'s inverse: (out, in) uint8 codes 0-15."""
    import torch

    return torch.stack([packed & 15, packed >> 4], dim=2).reshape(packed.shape[0], -1)


def open_folder(folder: str | Path) -> Stored | None:
    """The genlab quantized checkpoint in `folder`, checked; None when config.json
    declares no genlab quantization (or cannot be read: the loader says why). A
    ModelLoadError, one line naming the fault and the fix, for an unknown format, a
    block size not the format's, a module without its codes or scales, or codes and
    scales of the wrong type or shape."""
    path = Path(folder).expanduser()
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict) or (quantization := quantization_of(config)) is None:
        return None
    name = str(folder)
    fmt, modules, formats = _check_config(name, quantization)
    try:
        table = _tensor_table(path / WEIGHTS)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load {name}: its {WEIGHTS} cannot be read "
                             f"({error}); {REWRITE}") from None
    _check_tensors(name, {m: formats.get(m, fmt) for m in modules}, table)
    plain = tuple(t for t in table if not t.endswith((CODES, SCALES)))
    return Stored(path, fmt, modules, plain, config,
                  _float_shapes({m: formats.get(m, fmt) for m in modules}, plain, table),
                  formats)


def _float_shapes(formats: dict[str, str], plain: tuple[str, ...],
                  table: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """The float model's tensor shapes: a matrix's from its codes (two a byte in 4-bit);
    `formats`: each module's."""
    shapes = {name: table[name][1] for name in plain}
    for module, fmt in formats.items():
        rows, columns = table[module + ".weight" + CODES][1]
        shapes[module + ".weight"] = (rows, columns * (8 // _bits(fmt)))
    return shapes


def _check_config(name: str, quantization: dict[str, Any]
                  ) -> tuple[str, tuple[str, ...], dict[str, str]]:
    """The format, modules and other modules' formats quantization_config declares,
    checked."""
    from genlib.backends import quant

    fmt = quantization.get("format")
    if fmt not in quant.FORMATS:
        raise ModelLoadError(
            f"cannot load {name}: config.json's quantization_config names format {fmt!r}, "
            f"and genlab reads {', '.join(quant.FORMATS)}; {REWRITE}")
    block = quantization.get("block")
    if block != quant.FORMATS[fmt].block:
        raise ModelLoadError(
            f"cannot load {name}: config.json's quantization_config gives {fmt} blocks of "
            f"{block!r} weights, and {fmt}'s blocks are {quant.FORMATS[fmt].block}; {REWRITE}")
    modules = quantization.get("modules")
    if not isinstance(modules, list) or not modules or \
            not all(isinstance(m, str) and m for m in modules):
        raise ModelLoadError(f"cannot load {name}: config.json's quantization_config needs "
                             f"`modules`, the names of the quantized modules; {REWRITE}")
    formats = quantization.get("module_formats", {})
    output = quant.output_format(fmt)
    if not isinstance(formats, dict) or not all(
            module in modules and module in OUTPUT_MODULES and other == output
            for module, other in formats.items()):
        raise ModelLoadError(
            f"cannot load {name}: config.json's quantization_config has `module_formats` "
            f"{formats!r}; beside {fmt} it may give only the output matrix "
            f"({', '.join(OUTPUT_MODULES)}) format {output}; {REWRITE}")
    return fmt, tuple(modules), dict(formats)


def _tensor_table(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype and shape, read from the file's header alone."""
    header = _header(file)
    return {name: (str(entry["dtype"]), tuple(entry["shape"]))
            for name, entry in header.items() if name != "__metadata__"}


def _header(file: Path) -> dict[str, Any]:
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if not 0 < length <= 100 << 20:
            raise ValueError("not a safetensors file")
        header = json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file")
    return header


SAFETENSORS_DTYPES = {"I8": "int8", "U8": "uint8", "I16": "int16", "U16": "uint16",
                      "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
                      "F16": "float16", "BF16": "bfloat16", "F32": "float32",
                      "F64": "float64", "BOOL": "bool"}


def _check_tensors(name: str, formats: dict[str, str],
                   table: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """ModelLoadError unless each module (`formats`: each one's format) has codes and
    scales of its format's types and matching shapes, and the file holds no codes or
    scales of an undeclared module."""
    from genlib.backends import quant

    declared = {m + ".weight" + suffix for m in formats for suffix in (CODES, SCALES)}
    extra = sorted(t for t in table if t.endswith((CODES, SCALES)) and t not in declared)
    if extra:
        raise ModelLoadError(f"cannot load {name}: {WEIGHTS} holds {extra[0]}, of a module "
                             f"config.json's quantization_config does not list; {REWRITE}")
    for module, fmt in formats.items():
        codes, scales = (_entry(name, table, module + ".weight" + s) for s in (CODES, SCALES))
        dtypes = (SAFETENSORS_DTYPES.get(codes[0]), SAFETENSORS_DTYPES.get(scales[0]))
        if dtypes[0] != CODE_DTYPES[fmt] or dtypes[1] not in SCALE_DTYPES:
            raise ModelLoadError(
                f"cannot load {name}: {module}.weight is stored as {dtypes[0] or codes[0]} "
                f"codes and {dtypes[1] or scales[0]} scales, and {fmt} is "
                f"{CODE_DTYPES[fmt]} codes with float16 or float32 scales; {REWRITE}")
        columns = codes[1][1] * (8 // quant.FORMATS[fmt].bits) if len(codes[1]) == 2 else 0
        blocks = -(-columns // quant.FORMATS[fmt].block)
        if len(codes[1]) != 2 or scales[1] != (codes[1][0], blocks):
            raise ModelLoadError(
                f"cannot load {name}: {module}.weight's codes {list(codes[1])} and scales "
                f"{list(scales[1])} do not fit together as {fmt} (a scale for each "
                f"{quant.FORMATS[fmt].block} weights of a row); {REWRITE}")


def _entry(name: str, table: dict[str, tuple[str, tuple[int, ...]]], tensor: str
           ) -> tuple[str, tuple[int, ...]]:
    if tensor not in table:
        what = "codes" if tensor.endswith(CODES) else "scales"
        raise ModelLoadError(f"cannot load {name}: {WEIGHTS} has no {tensor} (the {what} "
                             f"of a quantized matrix config.json lists); {REWRITE}")
    return table[tensor]


def describe_folder(folder: str | Path) -> tuple[str | None, int | None]:
    """How a local model folder stores its weights (a quantized format, or the float
    dtype of its safetensors matrices) and the bytes of its files, for --stats and
    --json; (None, None) where it is not a local folder."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return None, None
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        quantization = quantization_of(config) if isinstance(config, dict) else None
        if quantization is not None:
            return str(quantization.get("format")), size
        dtypes = {dtype for dtype, shape in _tensor_table(path / WEIGHTS).values()
                  if len(shape) == 2}
    except (OSError, ValueError, KeyError, TypeError):
        return None, size
    names = sorted(SAFETENSORS_DTYPES.get(d, d.lower()) for d in dtypes)
    return "+".join(names) or None, size
