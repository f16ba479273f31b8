"""Weight quantization for the native kernel: blocks of weights along a matrix's input
dimension, each block one float32 scale and a small integer code per weight.

- q8_0 (llama.cpp's Q8_0): blocks of 32, int8 codes; a weight is code * scale,
  scale = absmax / 127, code = round(w / scale).
- nf4 (bitsandbytes' NF4): blocks of 64, 4-bit codes; a weight is NF4[code] * scale.
  bitsandbytes takes the block's absmax for the scale and each code the nearest of the
  16 NF4 levels to w / absmax; here a few candidate scales each give their nearest
  codes, each set of codes its least-squares scale, and the block keeps the pair of
  least squared error, absmax's among them (`_nf4`). A reader of NF4 dequantizes it
  the same way.
- q4_0 (llama.cpp's Q4_0): blocks of 32, 4-bit codes; a weight is (code - 8) * scale,
  scale = max / -8 where max is the block's weight of largest magnitude (its sign too).

Scales are float32 (llama.cpp stores float16): the kernel multiplies a block's sum by
its scale as a float32 vector load, with no conversion, and a dequantized weight is
exactly code times scale in float32, which the tests' reference forward runs. It costs
2 bytes a block more than float16: 6% of q8_0's reads, 3% of nf4's.

    codes, scales = quantize(weight, "q8_0")      # (out, in) int8/uint8, (out, blocks) float32
    weight_q = dequantize(codes, scales, "q8_0")  # (out, in) float32
    packed = pack(weight, panel, "q8_0")          # the kernel's layout (`kernel.pack_matrix`)
    packed = pack_codes(codes, scales, panel, "q8_0")  # the same, from stored codes

`pack` lays a matrix out as the kernel reads it (csrc/lean_step.c, `panel_tile`): panels
of `panel` rows, each panel its blocks in order, each block `panel` float32 scales (one a
row) then the codes column by column: q8_0 `panel` int8 a column; nf4 and q4_0 `panel/2`
bytes a column, byte j holding row j in its low nibble and row j + panel/2 in its high.
A last block shorter than the block size holds the columns there are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# bitsandbytes' NF4 levels (Dettmers et al. 2023, QLoRA, appendix E): quantiles of a
# normal distribution, scaled to [-1, 1], with an exact zero.
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


@dataclass(frozen=True)
class Format:
    """A quantized format: weights a block, bits a code."""

    name: str
    block: int
    bits: int


FORMATS = {f.name: f for f in (Format("q8_0", 32, 8), Format("nf4", 64, 4),
                               Format("q4_0", 32, 4))}

# nf4's candidate scales, as shares of a block's absmax (`_nf4`): absmax alone maps the
# largest weight to a level exactly and leaves the rest of the block coarse; a smaller
# scale, its codes' least-squares fit, cut the mean KL divergence from float32 by a fifth
# on code-target (docs/performance.md). Each candidate costs one pass over the weights.
NF4_SEARCH = (1.0, 0.9, 0.8, 0.7)
NF4_ROWS = 1024

# How `quantize` chooses a format's codes and scales, where it changed since the format
# came: part of the weight cache's key, so a change rebuilds what was packed before it.
ENCODERS = {"nf4": 2}

# The output matrix's format (the lm_head, or the embeddings where it is tied to them)
# where the others' is 4-bit, as llama.cpp's Q4_0 files keep it at 6 or 8 bits (Q6_K,
# Q8_0 where it is tied): in 4 bits it cost most of what the 4-bit formats lose
# (docs/performance.md). The kernel packs it so, and quantized checkpoints store it so.
OUTPUT_FORMAT = {"nf4": "q8_0", "q4_0": "q8_0"}


def output_format(name: str) -> str:
    """The output matrix's format beside matrices in format `name`."""
    return OUTPUT_FORMAT.get(name, name)


def format_of(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"the quantized formats are {', '.join(FORMATS)}, not {name}")
    return FORMATS[name]


def _blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """`weight` (out, in) as (out, blocks, block), its last block padded with zeros (which
    change no block's absmax); and `in`."""
    rows, columns = weight.shape
    padded = -(-columns // block) * block
    if padded != columns:
        weight = torch.cat([weight, weight.new_zeros(rows, padded - columns)], dim=1)
    return weight.reshape(rows, padded // block, block), columns


def quantize(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (out, in), as float32, in format `name`: its codes (out, in) (int8 for
    q8_0, uint8 0-15 for nf4 and q4_0) and scales (out, blocks) float32."""
    fmt = format_of(name)
    check_finite(weight, name)
    blocks, columns = _blocks(weight.detach().to(torch.float32), fmt.block)
    if name == "q8_0":
        scales = blocks.abs().amax(dim=2) / 127
        inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
        codes = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)
    elif name == "nf4":  # in slices of rows: bucketize's codes take 8 bytes a weight
        parts = [_nf4(part) for part in blocks.split(NF4_ROWS)]
        codes, scales = (torch.cat(halves) for halves in zip(*parts))
    else:  # q4_0, as llama.cpp's quantize_row_q4_0_ref
        at = blocks.abs().argmax(dim=2, keepdim=True)
        scales = blocks.gather(2, at)[..., 0] / -8
        inverse = torch.where(scales != 0, 1 / scales, torch.zeros_like(scales))
        codes = (blocks * inverse[..., None] + 8.5).to(torch.int8).clamp(max=15)
        codes = codes.to(torch.uint8)
    return codes.reshape(codes.shape[0], -1)[:, :columns].contiguous(), scales.contiguous()


class NonFiniteWeights(ValueError):
    """A matrix to quantize holds NaN or infinite weights: no scale stands for them."""


def check_finite(weight: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(weight).all()):
        raise NonFiniteWeights(f"it holds NaN or infinite weights, which {name} cannot "
                               f"quantize")


def nf4_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """NF4's 16 levels and the 15 middles between them (a weight's code is how many
    middles lie below it), float32: what `_nf4` and the kernel's encoder both compare
    with, so that they choose the same codes."""
    levels = torch.tensor(NF4, dtype=torch.float32)
    return levels, (levels[1:] + levels[:-1]) / 2


def _nf4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 codes and scales of `blocks` (out, blocks, 64): for each candidate scale
    (`NF4_SEARCH` times the block's absmax, float32) the nearest levels, then the scale
    that fits those codes best (least squares, summed in float64); the block keeps the
    pair of least squared error, the first on a tie, so never worse than absmax's. The
    kernel's `genlab_nf4_quantize` computes the same numbers (`kernel.quantize`)."""
    levels, middles = nf4_tables()
    absmax = blocks.abs().amax(dim=2)
    best = None
    for share in torch.tensor(NF4_SEARCH, dtype=torch.float32):
        scale = absmax * share
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        codes = torch.bucketize(blocks * inverse[..., None], middles)
        values = levels[codes]
        fit = torch.zeros(blocks.shape[:2], dtype=torch.float64)
        size = torch.zeros_like(fit)
        for column in range(blocks.shape[2]):  # in the kernel's order: the same bits
            level = values[..., column].double()
            fit += blocks[..., column].double() * level  # a product of floats is exact
            size += level * level
        fitted = torch.where(size > 0, fit / torch.where(size > 0, size, 1), 0)
        gain = fit * fitted  # the squared error is the block's sum of squares less this
        if best is None:
            best = [gain, codes, fitted]
            continue
        better = gain > best[0]
        best = [torch.where(better, gain, best[0]),
                torch.where(better[..., None], codes, best[1]),
                torch.where(better, fitted, best[2])]
    assert best is not None
    return best[1].to(torch.uint8), best[2].to(torch.float32)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """The float32 weights (out, in) that `codes` and `scales` stand for."""
    fmt = format_of(name)
    if name == "q8_0":
        values = codes.to(torch.float32)
    elif name == "nf4":
        values = torch.tensor(NF4, dtype=torch.float32)[codes.long()]
    else:
        values = codes.to(torch.float32) - 8
    blocks, columns = _blocks(values, fmt.block)
    scales = scales.to(torch.float32)  # float16 scales (a checkpoint's) widened, exactly
    return (blocks * scales[..., None]).reshape(codes.shape[0], -1)[:, :columns]


def packed_bytes(rows: int, columns: int, panel: int, name: str) -> int:
    """The bytes `pack` gives a (rows, columns) matrix."""
    fmt = format_of(name)
    panels = -(-rows // panel)
    blocks = -(-columns // fmt.block)
    return panels * panel * (4 * blocks + columns * fmt.bits // 8)


def pack(weight: torch.Tensor, panel: int, name: str) -> torch.Tensor:
    """`weight` (out, in) float32, quantized to `name` and laid out as the kernel reads it
    (the module doc): one 1-D uint8 tensor."""
    return pack_codes(*quantize(weight, name), panel, name)


def pack_codes(codes: torch.Tensor, scales: torch.Tensor, panel: int, name: str
               ) -> torch.Tensor:
    """`quantize`'s codes and scales (float32, or float16 widened to float32) laid out as
    `pack` lays them out: a quantized checkpoint's matrices, packed as stored."""
    fmt = format_of(name)
    scales = scales.to(torch.float32)
    rows, columns = codes.shape
    padded = -(-rows // panel) * panel
    if padded != rows:  # the last panel's missing rows: zero codes and scales
        codes = torch.cat([codes, codes.new_zeros(padded - rows, columns)])
        scales = torch.cat([scales, scales.new_zeros(padded - rows, scales.shape[1])])
    panels = padded // panel
    codes = codes.view(torch.uint8).reshape(panels, panel, columns)
    scales = scales.reshape(panels, panel, -1)
    if fmt.bits == 4:  # row j low nibble, row j + panel/2 high
        codes = codes[:, :panel // 2] | (codes[:, panel // 2:] << 4)
    parts = []
    for b, start in enumerate(range(0, columns, fmt.block)):
        block = codes[:, :, start:start + fmt.block].transpose(1, 2).reshape(panels, -1)
        parts += [scales[:, :, b].contiguous().view(torch.uint8), block]
    packed = torch.cat(parts, dim=1).reshape(-1).contiguous()
    assert packed.numel() == packed_bytes(rows, columns, panel, name)
    return packed
