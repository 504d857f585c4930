"""A quantized weight matrix, as loaders and core layers hold it: backend-neutral bytes plus
the plain-torch dequantization that is every kernel's reference.

Formats (a weight is [out, in]; blocks run along `in`, so a row's bytes are self-contained and
rows can be permuted or sliced without touching the quantization):
- "q4_0", "q4_1", "q8_0": GGUF/ggml blocks of 32 weights, kept byte for byte as the file has them.
  q4_0: fp16 d, 16 bytes of nibbles; w = d * (q - 8).
  q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m. Also what `--quantize int4` makes:
        asymmetric int4 in groups of 32 (`quantize_int4`).
  q8_0: fp16 d, 32 int8; w = d * q.
  Nibbles: byte j of a block holds weight j in its low half and weight j + 16 in its high half.
- "int8": per-output-channel symmetric int8 (`quantize_int8`): `data` int8 [out, in], `scales`
  float32 [out]; w = scales[:, None] * q.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per ggml block (and the int4 group size)
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
FORMATS = (*BLOCK_BYTES, "int8")


@dataclass(frozen=True)
class QuantizedWeight:
    """format: one of FORMATS; shape: (out, in) of the float weight it stands for; data: uint8
    [out, in / 32 * block bytes] for the block formats, int8 [out, in] for "int8"; scales:
    float32 [out] for "int8", None otherwise."""

    format: str
    shape: tuple[int, int]
    data: torch.Tensor
    scales: torch.Tensor | None = None

    def __post_init__(self):
        out, inp = self.shape
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantized format {self.format!r}; known: {FORMATS}")
        if self.format == "int8":
            if self.data.dtype != torch.int8 or tuple(self.data.shape) != (out, inp) or self.scales is None:
                raise ValueError(f"int8 weight needs int8 data {self.shape} and scales")
        elif inp % BLOCK or self.data.dtype != torch.uint8 or \
                tuple(self.data.shape) != (out, inp // BLOCK * BLOCK_BYTES[self.format]):
            raise ValueError(f"{self.format} weight {self.shape} has data {tuple(self.data.shape)} "
                             f"{self.data.dtype}; expected uint8 rows of {BLOCK_BYTES[self.format]}-byte blocks")

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation, a slice's arange, or looked-up token ids)."""
        scales = None if self.scales is None else self.scales[index]
        return QuantizedWeight(self.format, (len(index), self.shape[1]), self.data[index], scales)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (0 if self.scales is None else self.scales.numel() * 4)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] these bytes encode (the reference of every kernel)."""
        return dequantize(self).to(dtype)


def _fp16(data: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block of data [..., blocks, bytes], as float32."""
    return data[..., offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values 0..15 (low halves are weights 0-15, high 16-31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """float32 [out, in]."""
    return _dequantize(weight.format, weight.data, weight.scales, weight.shape[1])


def dequantize_rows(weight: QuantizedWeight, index: torch.Tensor) -> torch.Tensor:
    """float32 [len(index), in]: only the rows `index` (an embedding lookup)."""
    scales = None if weight.scales is None else weight.scales[index]
    return _dequantize(weight.format, weight.data[index], scales, weight.shape[1])


def _dequantize(fmt: str, data: torch.Tensor, scales: torch.Tensor | None, inp: int) -> torch.Tensor:
    if fmt == "int8":
        return data.float() * scales[:, None]
    blocks = data.view(data.shape[0], inp // BLOCK, BLOCK_BYTES[fmt])
    d = _fp16(blocks, 0)
    if fmt == "q8_0":
        values = d * blocks[..., 2:].contiguous().view(torch.int8).float()
    elif fmt == "q4_0":
        values = d * (_nibbles(blocks[..., 2:]) - 8)
    else:
        values = d * _nibbles(blocks[..., 4:]) + _fp16(blocks, 2)
    return values.reshape(data.shape[0], inp)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8 of a float [out, in] weight."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", tuple(weight.shape), q, scales)


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Asymmetric int4 in groups of 32 along `in` (q4_1 blocks: w ~ d * q + m, q in 0..15);
    `in` must be a multiple of 32."""
    out, inp = weight.shape
    if inp % BLOCK:
        raise ValueError(f"int4 groups of {BLOCK} do not divide in_features {inp}")
    groups = weight.detach().float().reshape(out, inp // BLOCK, BLOCK)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d = ((high - low) / 15).half()
    m = low.half()
    safe_d = torch.where(d == 0, torch.ones_like(d), d).float()
    q = torch.round((groups - m.float()) / safe_d).clamp(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    blocks = torch.cat([d.view(torch.uint8), m.view(torch.uint8), qs], dim=-1)
    return QuantizedWeight("q4_1", (out, inp), blocks.reshape(out, -1).contiguous())
