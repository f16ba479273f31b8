"""Write a float model folder as genlab's quantized checkpoint (genlib.models.qformat): every
weight matrix (the 2-D `.weight` tensors: projections, embeddings, output head; once
when tied) in a format of genlib.backends.quant, the output matrix in
`quant.output_format`'s (q8_0 beside a 4-bit format), everything else as it is.

    summary = write(Path("code-small"), Path("code-small-q8"), "q8_0")

The same input gives the same bytes: tensors are written in name order, config.json
with its keys in the source's order, the other files copied byte for byte.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from genlib.models import qformat

if TYPE_CHECKING:
    import torch

# Files of the source that are its weights or its config: rewritten, never copied.
NOT_COPIED = ("*.safetensors", "*.bin", "*.index.json", "*.pt", "*.gguf", "config.json")


class QuantizeError(Exception):
    """A source folder that cannot be written quantized, and why (one line)."""


@dataclass(frozen=True)
class Summary:
    """What `write` wrote."""

    out: Path
    format: str
    matrices: int
    source_bytes: int
    out_bytes: int


def write(source: Path, out: Path, fmt: str) -> Summary:
    """`source`'s model quantized to `fmt` in folder `out` (new, or empty)."""
    from genlib.backends import quant

    if fmt not in quant.FORMATS:
        raise QuantizeError(f"--format must be one of {', '.join(quant.FORMATS)}, not {fmt}")
    config = _source_config(source)
    tensors = _source_tensors(source)
    _check_out(out)
    formats = _other_formats(tensors, fmt)
    stored, modules = _quantized(tensors, fmt, formats)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(dict(sorted(stored.items())), str(out / qformat.WEIGHTS), metadata={"format": "pt"})
    (out / qformat.WEIGHTS).chmod(0o644)  # safetensors writes 0600: readable as its source
    config["quantization_config"] = {"quant_method": qformat.METHOD, "format": fmt,
                                     "block": quant.FORMATS[fmt].block, "modules": modules}
    if formats:
        config["quantization_config"]["module_formats"] = formats
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for file in sorted(source.iterdir()):
        if file.is_file() and not any(file.match(pattern) for pattern in NOT_COPIED):
            shutil.copyfile(file, out / file.name)
    return Summary(out, fmt, len(modules), _bytes(source), _bytes(out))


def _source_config(source: Path) -> dict:
    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise QuantizeError(f"{source} has no readable config.json ({error}); give a model "
                            f"folder in Hugging Face layout") from None
    if not isinstance(config, dict):
        raise QuantizeError(f"{source}/config.json is not a JSON object")
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method") \
            if isinstance(config["quantization_config"], dict) else None
        raise QuantizeError(f"{source} is quantized already ({method}); give the float model")
    return config


def _source_tensors(source: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = source / qformat.WEIGHTS
    if not file.is_file():
        raise QuantizeError(f"{source} has no {qformat.WEIGHTS} (one unsharded safetensors "
                            f"file is what this tool reads)")
    try:
        return load_file(str(file))
    except (OSError, SafetensorError) as error:
        raise QuantizeError(f"{file} cannot be read ({error})") from None


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QuantizeError(f"{out} exists and is not an empty folder; name a new one")


def _other_formats(tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, str]:
    """The modules to store in another format than `fmt`: the output matrix, where
    `quant.output_format` gives it one."""
    from genlib.backends import quant

    output = next((m for m in qformat.OUTPUT_MODULES if m + ".weight" in tensors), None)
    other = quant.output_format(fmt)
    return {output: other} if output is not None and other != fmt else {}


def _quantized(tensors: dict[str, torch.Tensor], fmt: str, formats: dict[str, str]
               ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors to store: each matrix's codes and scales (in `fmt`, or its module's
    format in `formats`), the rest as they are; and the quantized modules' names."""
    stored, modules = {}, []
    for name, tensor in sorted(tensors.items()):
        if not (name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()):
            stored[name] = tensor
            continue
        codes, scales = _matrix(name, tensor, formats.get(name.removesuffix(".weight"), fmt))
        stored[name + qformat.CODES], stored[name + qformat.SCALES] = codes, scales
        modules.append(name.removesuffix(".weight"))
    return stored, modules


def _matrix(name: str, weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix's codes as stored (4-bit: two a byte) and float16 scales."""
    import torch

    from genlib.backends import kernel, quant

    if quant.FORMATS[fmt].bits == 4 and weight.shape[1] % 2:
        raise QuantizeError(f"{name} has {weight.shape[1]} columns; {fmt} stores two codes "
                            f"a byte and needs an even number (use q8_0)")
    try:
        codes, scales = kernel.quantize(weight.to(torch.float32), fmt)  # nf4's the fast way
    except quant.NonFiniteWeights as error:
        raise QuantizeError(f"{name}: {error}; the source model's weights are damaged"
                            ) from None
    half = scales.to(torch.float16)
    if not torch.isfinite(half).all():
        raise QuantizeError(f"{name} has weights beyond float16's range for its scales; "
                            f"this format cannot hold it")
    if quant.FORMATS[fmt].bits == 4:
        codes = qformat.pack_nibbles(codes)
    return codes.contiguous(), half.contiguous()


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
