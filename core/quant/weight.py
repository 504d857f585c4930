"""A quantized weight matrix, as loaders and core layers hold it: backend-neutral bytes plus
the plain-torch dequantization that is every kernel's reference.

Formats (a weight is [out, in]; blocks run along `in`, so a row's bytes are self-contained and
rows can be permuted or sliced without touching the quantization):
- GGUF/ggml blocks, kept byte for byte as the file has them (BLOCK_WEIGHTS weights in
  BLOCK_BYTES bytes; `affine_blocks` is the one description of their layouts):
  q4_0, q5_0, q8_0 (32 weights: fp16 d, 4/5/8-bit q; w = d * (q - 8 / 16 / 0), q8_0's q int8),
  q4_1, q5_1 (32: fp16 d, fp16 m; w = d * q + m). q4_1 is also what `--quantize int4` makes
  (asymmetric int4 in groups of 32, `quantize_int4`).
  q4_k, q5_k (256: fp16 d, dmin, 6-bit scale and min per 32; w = d*sc * q - dmin*m),
  q6_k (256: int8 scale per 16, fp16 d; w = d*sc * (q - 32)).
  Every one is w = d * u + c per group of 32 (16 for q6_k) with u unsigned: `affine_blocks`.
- "int8": per-output-channel symmetric int8 (`quantize_int8`): `data` int8 [out, in], `scales`
  float32 [out]; w = scales[:, None] * q.
- SCALED_FORMATS (bnb_nf4, bnb_fp4, bnb_int8, fp8_e4m3): a code value times a float32 scale per
  (row, group of columns), `scales` [out, groups]; scaled.py describes and checks them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .scaled import BNB_BLOCKSIZE, FP8_MAX, QUANT_TYPES, SCALED_FORMATS, check_scaled, dequantize_scaled

BLOCK = 32  # weights per q4_0/q4_1/q5_0/q5_1/q8_0 block (and the int4 group size)
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q5_0": 22, "q5_1": 24, "q4_k": 144, "q5_k": 176, "q6_k": 210}
BLOCK_WEIGHTS = {"q4_0": 32, "q4_1": 32, "q8_0": 32, "q5_0": 32, "q5_1": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256}
FORMATS = (*BLOCK_BYTES, *SCALED_FORMATS, "int8")
# (group, bits) of each block format's affine form (AffineBlocks).
GROUP_BITS = {"q4_0": (32, 4), "q4_1": (32, 4), "q8_0": (32, 8), "q5_0": (32, 5), "q5_1": (32, 5),
               "q4_k": (32, 4), "q5_k": (32, 5), "q6_k": (16, 6)}


@dataclass(frozen=True)
class QuantizedWeight:
    """format: one of FORMATS; shape: (out, in) of the float weight it stands for; data: uint8
    [out, in / BLOCK_WEIGHTS * BLOCK_BYTES] for the block formats, int8 [out, in] for "int8";
    scales: float32 [out] for "int8", None otherwise."""

    format: str
    shape: tuple[int, int]
    data: torch.Tensor
    scales: torch.Tensor | None = None
    # act-order (GPTQ desc_act): int64 [in]; the layer computes x[:, input_order] @ W^T, W's columns
    # sorted by quantization group (core/quant/hub). None: x as it comes.
    input_order: torch.Tensor | None = None

    def __post_init__(self):
        out, inp = self.shape
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantized format {self.format!r}; known: {FORMATS}")
        if self.format in SCALED_FORMATS:
            check_scaled(self.format, self.shape, self.data, self.scales)
        elif self.format == "int8":
            if self.data.dtype != torch.int8 or tuple(self.data.shape) != (out, inp) or self.scales is None:
                raise ValueError(f"int8 weight needs int8 data {self.shape} and scales")
        else:
            weights, nbytes = BLOCK_WEIGHTS[self.format], BLOCK_BYTES[self.format]
            if inp % weights or self.data.dtype != torch.uint8 or \
                    tuple(self.data.shape) != (out, inp // weights * nbytes):
                raise ValueError(f"{self.format} weight {self.shape} has data {tuple(self.data.shape)} "
                                 f"{self.data.dtype}; expected uint8 rows of {nbytes}-byte blocks of "
                                 f"{weights} weights (in a multiple of {weights})")

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation, a slice's arange, or looked-up token ids)."""
        scales = None if self.scales is None else self.scales[index]
        return QuantizedWeight(self.format, (len(index), self.shape[1]), self.data[index], scales, self.input_order)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (0 if self.scales is None else self.scales.numel() * 4)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] these bytes encode (the reference of every kernel)."""
        return dequantize(self).to(dtype)


@dataclass(frozen=True)
class AffineBlocks:
    """A block-format weight as w = d * u + c per group of `group` weights along `in`:
    d, c float32 [out, in / group]; u uint8 [out, in / group, group], 0 <= u < 2 ** bits."""

    d: torch.Tensor
    c: torch.Tensor
    u: torch.Tensor
    group: int
    bits: int


def affine_blocks(weight: QuantizedWeight) -> AffineBlocks:
    """The weight's blocks in affine form (`w = d * u + c`, exactly, for every weight)."""
    if weight.format not in BLOCK_BYTES:
        raise ValueError(f"{weight.format!r} is not a block format ({tuple(BLOCK_BYTES)})")
    return _affine(weight.format, weight.data, weight.shape[1])


def _fp16(data: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of each block of data [..., blocks, bytes], as float32
    [..., blocks, 1]."""
    return data[..., offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low halves, then the n high halves."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] values 0/1: bit i of the uint32."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[..., :, None] >> shifts) & 1).flatten(-2)


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] bytes -> the 8 six-bit scales and 8 six-bit mins [..., 8] (ggml's
    get_scale_min_k4): bytes 0-3 hold scales 0-3 (low 6 bits) and the high 2 bits of scales
    4-7, bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scale (low nibble) and
    min (high nibble) 4-7."""
    sc, mn, low = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    scale = torch.cat([sc & 0x3F, (low & 0x0F) | ((sc >> 2) & 0x30)], dim=-1)
    minimum = torch.cat([mn & 0x3F, (low >> 4) | ((mn >> 2) & 0x30)], dim=-1)
    return scale, minimum


def _affine(fmt: str, data: torch.Tensor, inp: int) -> AffineBlocks:
    """AffineBlocks of block-format rows data uint8 [rows, bytes] of `inp` weights each. Every
    d * u is exact in float32 (fp16 d times a scale of at most 8 bits times u of at most 8
    bits), so w = d * u + c rounds once, as ggml's own d * q + m or d * q - dm does."""
    rows = data.shape[0]
    b = data.reshape(rows, inp // BLOCK_WEIGHTS[fmt], BLOCK_BYTES[fmt])  # [rows, blocks, bytes]
    group, bits = GROUP_BITS[fmt]
    if fmt in ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1"):
        d = _fp16(b, 0)
        if fmt == "q8_0":  # int8 q + 128, as a byte: the sign bit flipped
            u, c = b[..., 2:] ^ 0x80, -128 * d
        elif fmt == "q4_0":
            u, c = _nibbles(b[..., 2:]), -8 * d
        elif fmt == "q4_1":
            u, c = _nibbles(b[..., 4:]), _fp16(b, 2)
        elif fmt == "q5_0":  # qh: bit i is weight i's fifth bit
            u, c = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << 4), -16 * d
        else:
            u, c = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8]) << 4), _fp16(b, 2)
    elif fmt in ("q4_k", "q5_k"):
        # d, dmin, 12 bytes of scales/mins, [q5_k: 32 bytes qh], 128 bytes qs. qs byte l of
        # chunk i (32 bytes) holds weight l of sub-block 2i (low) and of 2i + 1 (high); qh byte l
        # holds bit j = the fifth bit of weight l of sub-block j.
        scale, minimum = scale_min_k4(b[..., 4:16])
        d, c = _fp16(b, 0) * scale.float(), -(_fp16(b, 2) * minimum.float())  # [rows, blocks, 8]
        qs = b[..., -128:].reshape(rows, -1, 4, 1, 32)
        u = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(rows, -1, 8, 32)
        if fmt == "q5_k":
            shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]
            u = u | (((b[..., None, 16:48] >> shifts) & 1) << 4)
    else:  # q6_k: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d
        # Each half (128 weights) has 64 ql bytes, byte l holding weight l (low nibble) and
        # l + 64 (high), and 32 qh bytes, byte l holding weight l + 32t's 2 high bits at bit 2t.
        ql = b[..., :128].reshape(rows, -1, 2, 1, 64)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(rows, -1, 2, 4, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]
        high = (b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> shifts) & 0x03
        u = low | (high << 4)
        d = _fp16(b, 208) * b[..., 192:208].view(torch.int8).float()  # [rows, blocks, 16]
        c = -32 * d
    groups = inp // group
    d, c = d.reshape(rows, groups), c.reshape(rows, groups)
    return AffineBlocks(d.contiguous(), c.contiguous(), u.reshape(rows, groups, group), group, bits)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """float32 [out, in]."""
    return _dequantize(weight.format, weight.data, weight.scales, weight.shape[1])


def dequantize_rows(weight: QuantizedWeight, index: torch.Tensor) -> torch.Tensor:
    """float32 [len(index), in]: only the rows `index` (an embedding lookup)."""
    scales = None if weight.scales is None else weight.scales[index]
    return _dequantize(weight.format, weight.data[index], scales, weight.shape[1])


def _dequantize(fmt: str, data: torch.Tensor, scales: torch.Tensor | None, inp: int) -> torch.Tensor:
    if fmt in SCALED_FORMATS:
        return dequantize_scaled(fmt, data, scales, inp)
    if fmt == "int8":
        return data.float() * scales[:, None]
    a = _affine(fmt, data, inp)
    return (a.d[..., None] * a.u.float() + a.c[..., None]).reshape(data.shape[0], inp)


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


def quantize_bnb(weight: torch.Tensor, fmt: str):
    """A float [out, in] weight quantized by bitsandbytes itself, as TGI's --quantize bitsandbytes*
    does: 4-bit with `quantize_4bit` (blocks of 64, double-quantized absmax as TGI's
    compress_statistics=True, then dequantized to float32 by bitsandbytes' dequantize_blockwise),
    LLM.int8 with `int8_vectorwise_quant` of the fp16 weight (what Int8Params does). Returns None
    where the format cannot hold it (4-bit: in % 64)."""
    import bitsandbytes.functional as F

    out, inp = weight.shape
    weight = weight.detach()
    if fmt == "bnb_int8":
        q, scb, _ = F.int8_vectorwise_quant(weight.to(torch.float16))
        return QuantizedWeight(fmt, (out, inp), q.contiguous(), scb.float().reshape(out, 1).contiguous())
    if inp % BNB_BLOCKSIZE:
        return None
    source = weight if weight.dtype in (torch.float32, torch.bfloat16, torch.float16) else weight.float()
    packed, state = F.quantize_4bit(source.contiguous(), blocksize=BNB_BLOCKSIZE, quant_type=QUANT_TYPES[fmt],
                                    compress_statistics=True)
    absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return QuantizedWeight(fmt, (out, inp), packed.reshape(out, inp // 2).contiguous(),
                           absmax.float().reshape(out, inp // BNB_BLOCKSIZE).contiguous())


def quantize_fp8(weight: torch.Tensor):
    """A float [out, in] weight as float8 e4m3fn with one scale per output channel (max |w| / 448,
    as llm-compressor's FP8_DYNAMIC weights), rounded by torch's float8 cast: TGI's --quantize fp8."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (weight / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8_e4m3", tuple(weight.shape), q.view(torch.uint8).contiguous(), scales.contiguous())
