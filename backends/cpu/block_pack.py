"""The tile layout csrc/block_matmul.cpp multiplies: a q4_0 / q4_1 / q8_0 weight repacked once at
load, still 4 or 8 bits a weight (never dequantized), so that one AVX512-VNNI instruction takes
4 weights of 16 output rows at once (llama.cpp's CPU backend repacks its blocks the same way).

Rows go in tiles of 16 (the last padded with zero rows). Tile t, block b (the 32 weights
32b..32b+31 of each of the tile's rows) is one record:
    fp16 d[16], fp16 c[16]      w = d[r] * u + c[r] for every weight of tile row r in the block
    payload                     u, unsigned: 4 bits (256 bytes) or 8 bits (512 bytes)
with u = q, c = m for q4_1; u = q, c = -8d for q4_0; u = q + 128, c = -128d for q8_0.
The payload is 8 chunks j of 16 four-byte lanes: lane r of chunk j holds row r's u of weights
4j..4j+3. With 4 bits, chunk 2g is the low nibbles and chunk 2g+1 the high nibbles of the
64 bytes of group g. The records of a tile are contiguous, tile after tile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from switchyard.core.quant import BLOCK, BLOCK_BYTES, QuantizedWeight

TILE_ROWS = 16
HEADER_BYTES = 64
BITS = {"q4_0": 4, "q4_1": 4, "q8_0": 8}


def record_bytes(bits: int) -> int:
    return HEADER_BYTES + (256 if bits == 4 else 512)


@dataclass(frozen=True)
class PackedBlocks:
    """A repacked weight: `data` uint8 [tiles, in / 32 * record bytes]; `shape` (out, in)."""

    data: torch.Tensor
    shape: tuple[int, int]
    bits: int


def _fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0].float()


def scales_and_values(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, c) float32 [out, blocks] and u uint8 [out, blocks, 32] with w = d * u + c."""
    out, inp = weight.shape
    blocks = weight.data.view(out, inp // BLOCK, BLOCK_BYTES[weight.format])
    d = _fp16_field(blocks, 0)
    if weight.format == "q8_0":
        u = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return d, -128 * d, u
    head = 4 if weight.format == "q4_1" else 2
    qs = blocks[..., head:]
    u = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # byte j: weight j (low), weight j + 16 (high)
    c = _fp16_field(blocks, 2) if weight.format == "q4_1" else -8 * d
    return d, c, u


def pack_blocks(weight: QuantizedWeight) -> PackedBlocks:
    """The weight in csrc/block_matmul.cpp's tiles (see the module docstring)."""
    if weight.format not in BITS:
        raise ValueError(f"block kernel formats are {tuple(BITS)}, not {weight.format!r}")
    bits, (out, inp) = BITS[weight.format], weight.shape
    d, c, u = scales_and_values(weight)
    pad = -out % TILE_ROWS
    if pad:  # zero rows: d = c = 0, so they add nothing (and are never stored)
        d, c = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (d, c))
        u = torch.nn.functional.pad(u, (0, 0, 0, 0, 0, pad))
    tiles, blocks = (out + pad) // TILE_ROWS, inp // BLOCK
    # [tiles, 16 rows, blocks, ...] -> [tiles, blocks, ...] with the 16 rows innermost per field
    header = torch.stack([d, c], dim=-1).to(torch.float16).view(tiles, TILE_ROWS, blocks, 2)
    header = header.permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(tiles, blocks, HEADER_BYTES)
    u = u.view(tiles, TILE_ROWS, blocks, BLOCK)
    if bits == 8:  # chunk j, lane r, byte i = u[r, 4j + i]
        payload = u.view(tiles, TILE_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    else:  # group g, lane r, byte i = u[r, 8g + i] | u[r, 8g + 4 + i] << 4
        halves = u.view(tiles, TILE_ROWS, blocks, 4, 2, 4)
        payload = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    payload = payload.reshape(tiles, blocks, -1)
    data = torch.cat([header, payload], dim=-1).reshape(tiles, blocks * record_bytes(bits)).contiguous()
    return PackedBlocks(data, weight.shape, bits)


def unpack_reference(packed: PackedBlocks) -> torch.Tensor:
    """float32 [out, in] from the tiles alone: the layout's test (it must equal the weight's
    dequantization)."""
    out, inp = packed.shape
    blocks, bits = inp // BLOCK, packed.bits
    records = packed.data.view(-1, blocks, record_bytes(bits))
    tiles = records.shape[0]
    header = records[..., :HEADER_BYTES].contiguous().view(torch.float16).float().view(tiles, blocks, 2, TILE_ROWS)
    d, c = header[:, :, 0], header[:, :, 1]  # [tiles, blocks, 16]
    payload = records[..., HEADER_BYTES:]
    if bits == 8:
        u = payload.reshape(tiles, blocks, 8, TILE_ROWS, 4).permute(0, 1, 3, 2, 4).reshape(tiles, blocks, TILE_ROWS, 32)
    else:
        groups = payload.reshape(tiles, blocks, 4, TILE_ROWS, 4).permute(0, 1, 3, 2, 4)
        u = torch.stack([groups & 0x0F, groups >> 4], dim=-2).reshape(tiles, blocks, TILE_ROWS, 32)
    w = d[..., None] * u.float() + c[..., None]  # [tiles, blocks, 16, 32]
    return w.permute(0, 2, 1, 3).reshape(tiles * TILE_ROWS, inp)[:out]
