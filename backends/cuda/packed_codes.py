"""The weight layout of the CUDA backend's Triton dequantize-GEMM (kernels/dequant_gemm.py), in
plain torch: packing, unpacking and the float weight it stands for (the kernel's reference).

A weight W [N, K] (out, in) is w = d * u + c per group of `group` consecutive input columns: u an
unsigned `bits`-bit code, d (scale) and c (offset) one pair per (group, output column). Every core
quantized format has this form (core/quant/weight.py `affine_blocks`; "int8" is u = q + 128,
c = -128 d, one group per row). Stored K-major, so that neighbouring output columns (one program's
BLOCK_N, and a warp's threads) read neighbouring bytes:
- codes: 4 bits: int32 [K / 8, N], value j of word (w, n) = u[n, 8w + j] in bits 4j..4j+3 (GPTQ's
  own qweight layout, so Marlin's repack reads it as it is); 5, 6 and 8 bits: uint8 [K, N], one code
  per byte (int8 for signed 8-bit codes: "int8" is w = d * q exactly, with c = 0).
- scales, offsets: [K / group, N], float16 where every value of the weight is exact in float16
  (the ggml formats' d and m, GPTQ / AWQ scales), else float32 (K-quants' d * sub-block scale,
  int8's per-channel scales): the repack never rounds.
`coarsen` merges runs of groups whose scales and offsets are equal: core converts GPTQ / AWQ
groups of 64 or 128 (or whole rows) into 32-weight blocks that repeat them, and this gives the
checkpoint's own group back (less scale traffic, and what Marlin needs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PACKED_BITS = (4, 5, 6, 8)
WORD_CODES = 8  # 4-bit codes per int32 word


@dataclass(frozen=True)
class PackedCodes:
    codes: torch.Tensor  # 4 bits: int32 [K / 8, N]; else uint8 (or signed int8, 8 bits) [K, N]
    scales: torch.Tensor  # d: [K / group, N], float16 or float32
    offsets: torch.Tensor  # c: like scales
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the float weight."""
        return self.scales.shape[1], self.scales.shape[0] * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))


def coarsen(d: torch.Tensor, c: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """d, c [N, K / group] -> the same weight's (d, c, group) with the largest group among K (one
    per row) and group * 2^i (dividing K) whose runs of groups all share their d and c (exact)."""
    n, groups = d.shape
    k = groups * group
    candidates = [k] + [group << i for i in range(12, 0, -1) if (group << i) < k and k % (group << i) == 0]
    for coarse in candidates:
        run = coarse // group
        dr, cr = d.reshape(n, groups // run, run), c.reshape(n, groups // run, run)
        if torch.equal(dr, dr[..., :1].expand_as(dr)) and torch.equal(cr, cr[..., :1].expand_as(cr)):
            return dr[..., 0].contiguous(), cr[..., 0].contiguous(), coarse
    return d, c, group


def scale_dtype(d: torch.Tensor, c: torch.Tensor) -> torch.dtype:
    """float16 where it holds every d and c exactly, else float32."""
    exact = all(bool(torch.equal(t.half().float(), t)) for t in (d, c))
    return torch.float16 if exact else torch.float32


def pack_codes(u: torch.Tensor, d: torch.Tensor, c: torch.Tensor, group: int, bits: int) -> PackedCodes:
    """u uint8 [N, K] (codes < 2^bits; or int8, signed 8-bit codes), d and c float32 [N, K / group]
    -> PackedCodes on u's device (groups coarsened first)."""
    if bits not in PACKED_BITS:
        raise ValueError(f"{bits}-bit codes are not packed here (one of {PACKED_BITS})")
    if u.dtype != torch.uint8 and not (u.dtype == torch.int8 and bits == 8):
        raise ValueError(f"codes are uint8 (or int8 for signed 8-bit ones), not {u.dtype}")
    n, k = u.shape
    if k % group or d.shape != (n, k // group) or c.shape != d.shape:
        raise ValueError(f"codes [{n}, {k}] with scales {tuple(d.shape)} do not form groups of {group}")
    d, c, group = coarsen(d.float(), c.float(), group)
    dtype = scale_dtype(d, c)
    if bits == 4:
        if k % WORD_CODES:
            raise ValueError(f"4-bit codes need K a multiple of {WORD_CODES}, not {k}")
        values = u.T.reshape(k // WORD_CODES, WORD_CODES, n)
        codes = torch.zeros((k // WORD_CODES, n), dtype=torch.int32, device=u.device)
        for j in range(WORD_CODES):  # one int32 plane at a time (code 7's shift wraps into the sign bit)
            codes |= values[:, j].to(torch.int32) << (4 * j)
    else:
        codes = u.T.contiguous()
    return PackedCodes(codes.contiguous(), d.T.to(dtype).contiguous(), c.T.to(dtype).contiguous(), bits, group)


def concat_columns(packs: list[PackedCodes]) -> PackedCodes:
    """Packs of one layout (bits, group, scale dtype) side by side: their output columns joined."""
    first = packs[0]
    if any((p.bits, p.group, p.scales.dtype) != (first.bits, first.group, first.scales.dtype) for p in packs):
        raise ValueError("only packs of one layout are joined")
    return PackedCodes(*(torch.cat([getattr(p, f) for p in packs], dim=1).contiguous()
                         for f in ("codes", "scales", "offsets")), first.bits, first.group)


def unpack_codes(packed: PackedCodes) -> torch.Tensor:
    """[N, K]: the codes u (uint8; int8 where they are signed)."""
    n, k = packed.shape
    if packed.bits == 4:
        shifts = torch.arange(WORD_CODES, device=packed.codes.device, dtype=torch.int32) * 4
        values = (packed.codes[:, None, :] >> shifts[None, :, None]) & 0xF  # [K / 8, 8, N]
        return values.reshape(k, n).T.to(torch.uint8)
    return packed.codes.T


def dequantize_packed(packed: PackedCodes) -> torch.Tensor:
    """float32 [N, K]: the weight the pack stands for (d * u + c, as the kernel computes it)."""
    d = packed.scales.float().repeat_interleave(packed.group, dim=0)  # [K, N]
    c = packed.offsets.float().repeat_interleave(packed.group, dim=0)
    return (d * unpack_codes(packed).T.float() + c).T
