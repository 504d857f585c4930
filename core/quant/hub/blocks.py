"""A Hub checkpoint's integer weights, as every reader here unpacks them, into a QuantizedWeight.

Every supported scheme is w = s * (u - z) per group of `group` input columns: u unsigned
(0..2^bits - 1), s a float scale and z an integer zero point per (output row, group). Groups of
32, 64, 128, ... (any multiple of 32, or the whole row) map onto 32-weight blocks, a group of more
than 32 repeating its scale (and zero) in each of its blocks:
- 4 bits, z = 8 everywhere (symmetric): "q4_0" (d = s, w = d * (u - 8)): exact (s is fp16 in
  GPTQ/AWQ checkpoints; a bf16 or float32 scale is rounded to fp16 once).
- 4 bits, any z (asymmetric): "q4_1" (d = s, m = -s * z, both fp16; w = d * u + m): exact but for
  m's rounding to fp16 (s * z needs up to 15 significant bits, fp16 keeps 11).
- 8 bits, z = 128 (symmetric), one group per row: "int8" (float32 scale per row, q = u - 128): exact.
- 8 bits, z = 128, groups: "q8_0" (d = s, q = u - 128): exact for fp16 scales.
Act-order checkpoints (GPTQ desc_act: a column's group is g_idx[column], not column // group)
have their columns sorted by group (a stable sort) and `input_order` set to that order. Anything
else is refused with one line (UnsupportedCheckpoint) naming what is supported.
"""
from __future__ import annotations

import torch

from ..methods import QuantizeError
from ..weight import BLOCK, QuantizedWeight

SUPPORTED = ("4-bit weights in groups of 32, 64, 128 (any multiple of 32) or per channel, symmetric or "
             "asymmetric, act-order or not; 8-bit symmetric weights per group or per channel")


class UnsupportedCheckpoint(QuantizeError):
    """A checkpoint's quantization that is not served (one line, naming what is)."""


def refuse(what: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"checkpoint quantization not supported: {what}; the CPU serves {SUPPORTED}")


def check_bits_and_group(bits: int, group: int, symmetric: bool, what: str) -> None:
    """Refuses what blocks cannot hold; group -1: one group per row."""
    if bits not in (4, 8):
        raise refuse(f"{what}, {bits}-bit weights")
    if group != -1 and (group <= 0 or group % BLOCK):
        raise refuse(f"{what}, group size {group}")
    if bits == 8 and not symmetric:
        raise refuse(f"{what}, asymmetric 8-bit weights")


def group_order(g_idx: torch.Tensor | None, inp: int, group: int, what: str) -> torch.Tensor | None:
    """The column order that makes each group contiguous (None: already in order). Refuses a
    g_idx whose groups are not `group` columns each."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    expected = torch.arange(inp) // group
    if torch.equal(g_idx, expected):
        return None
    order = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[order], expected):
        raise refuse(f"{what}, a g_idx whose groups are not {group} columns each")
    return order


def to_quantized(u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, what: str,
                 order: torch.Tensor | None = None) -> QuantizedWeight:
    """u: integer [out, in] (0..2^bits - 1) in the checkpoint's column order; scale: float
    [out, groups]; zero: integer [out, groups] (the unsigned zero point); order: the columns
    sorted by group (group_order), or None. Groups are in / groups contiguous columns (after
    `order`)."""
    out, inp = u.shape
    groups = scale.shape[1]
    if inp % BLOCK or inp % groups or (inp // groups) % BLOCK:
        raise refuse(f"{what}, {inp} input columns in {groups} groups (blocks of {BLOCK})")
    if order is not None:
        u = u[:, order]
    middle = 1 << (bits - 1)
    symmetric = bool((zero == middle).all())
    if bits == 8 and not symmetric:
        raise refuse(f"{what}, asymmetric 8-bit weights")
    if bits == 8 and groups == 1:
        q = (u.to(torch.int16) - middle).to(torch.int8).contiguous()
        return QuantizedWeight("int8", (out, inp), q, scale[:, 0].float().contiguous(), order)
    per_block = inp // groups // BLOCK
    d = scale.float().repeat_interleave(per_block, dim=1).half()  # [out, in / 32]
    u = u.to(torch.uint8).reshape(out, inp // BLOCK, BLOCK)
    if bits == 8:
        q = (u ^ 0x80).view(torch.int8)  # u - 128, as a byte: the sign bit flipped
        blocks = torch.cat([_bytes(d), q.view(torch.uint8)], dim=-1)
        return QuantizedWeight("q8_0", (out, inp), blocks.reshape(out, -1).contiguous(), None, order)
    nibbles = u[..., :16] | (u[..., 16:] << 4)  # byte j: weight j (low), weight j + 16 (high)
    if symmetric:
        blocks = torch.cat([_bytes(d), nibbles], dim=-1)
        return QuantizedWeight("q4_0", (out, inp), blocks.reshape(out, -1).contiguous(), None, order)
    m = (-(scale.float() * zero.float())).repeat_interleave(per_block, dim=1).half()
    blocks = torch.cat([_bytes(d), _bytes(m), nibbles], dim=-1)
    return QuantizedWeight("q4_1", (out, inp), blocks.reshape(out, -1).contiguous(), None, order)


def _bytes(values: torch.Tensor) -> torch.Tensor:
    """fp16 [out, blocks] -> uint8 [out, blocks, 2] (little-endian, as ggml blocks hold them)."""
    return values.contiguous().view(torch.uint8).reshape(*values.shape, 2)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-bit values packed into int32 words along `dim` (value k of a word in bits
    k*bits..), unpacked along that dim: int64, the dim 32 / bits times longer."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    moved = words.movedim(dim, -1)
    values = (moved[..., None] >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2).movedim(-1, dim)
