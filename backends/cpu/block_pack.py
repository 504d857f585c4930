"""The tile layout csrc/block_matmul.cpp multiplies: a block-format weight (q4_0, q4_1, q5_0,
q5_1, q8_0, q4_k, q5_k, q6_k; core/quant/weight.py) repacked once at load, still 4 to 8 bits a
weight (never dequantized), so that one AVX512-VNNI instruction takes 4 weights of 16 output
rows at once (llama.cpp's CPU backend repacks its blocks the same way).

Every format is read as w = d * u + c with u unsigned of `bits` bits and (d, c) per `group`
weights (core's `affine_blocks`): (4, 32) for q4_0/q4_1/q4_k, (5, 32) for q5_0/q5_1/q5_k,
(6, 16) for q6_k, (8, 32) for q8_0. d and c are stored as fp16: exact for the formats whose
scales are fp16 fields (q4_0, q4_1, q5_*, q8_0); for the k-quants d = d_super * sub-scale is
rounded once to fp16 (a relative change of at most 2^-11, far below the weights' own rounding).

Rows go in tiles of 16 (the last padded with zero rows). Tile t, block b (the 32 weights
32b..32b+31 of each of the tile's rows) is one record:
    per scale group g of the block (1, or 2 for group 16): fp16 d[16], fp16 c[16]
    payload: 8 chunks j of 16 four-byte lanes, lane r of chunk j = row r's u of weights 4j..4j+3
      8 bits: the chunks themselves (512 bytes)
      4-6 bits: the low nibbles, chunk 2q and 2q+1 in the 64 bytes of nibble group q (byte i of
        lane r = u[r, 8q + i] & 15 | (u[r, 8q + 4 + i] & 15) << 4; 256 bytes), then one 64-byte
        plane per bit above 4: chunk j's 8 bytes are a 64-bit word whose bit 4r + i is that bit
        of u[r, 4j + i].
The records of a tile are contiguous, tile after tile. A weight whose rows come in parts of
different formats (a fused q/k/v of a Q4_K_M file: q, k Q4_K, v Q6_K) is one segment per part,
each padded to whole tiles, one after the other; `segments` [S, 4] int64 says (rows, bits,
group, byte offset) of each, and the kernel writes each into its own output columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from switchyard.core.quant import BLOCK, QuantizedWeight, affine_blocks

TILE_ROWS = 16
LAYOUTS = ((4, 32), (5, 32), (6, 16), (8, 32))  # (bits, group) the kernel multiplies
PACK_ROWS = 1024  # rows repacked at a time (a multiple of TILE_ROWS): bounds the transient memory


def record_bytes(bits: int, group: int) -> int:
    return 64 * (BLOCK // group) + (512 if bits == 8 else 256 + 64 * (bits - 4))


@dataclass(frozen=True)
class PackedBlocks:
    """A repacked weight: `data` uint8 [bytes], `segments` int64 [S, 4] (rows, bits, group,
    byte offset); `shape` (out, in)."""

    data: torch.Tensor
    segments: torch.Tensor
    shape: tuple[int, int]


def pack_affine(d: torch.Tensor, c: torch.Tensor, u: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """The tiles (see the module docstring) of one part: d, c float [out, in / group], u uint8
    [out, in / group, group]; uint8 [tiles * blocks * record bytes]."""
    if (bits, group) not in LAYOUTS:
        raise ValueError(f"no tile layout for {bits}-bit weights in groups of {group}")
    out, inp = d.shape[0], d.shape[1] * group
    groups, blocks = BLOCK // group, inp // BLOCK
    pad = -out % TILE_ROWS
    if pad:  # zero rows: d = c = 0, so they add nothing (and are never stored)
        d, c = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (d, c))
        u = torch.nn.functional.pad(u, (0, 0, 0, 0, 0, pad))
    tiles = (out + pad) // TILE_ROWS
    # [tiles, 16 rows, blocks, groups, (d, c)] -> [tiles, blocks, groups, (d, c), 16 rows]
    header = torch.stack([d, c], dim=-1).to(torch.float16).view(tiles, TILE_ROWS, blocks, groups, 2)
    header = header.permute(0, 2, 3, 4, 1).contiguous().view(torch.uint8).reshape(tiles, blocks, 64 * groups)
    u = u.reshape(tiles, TILE_ROWS, blocks, BLOCK)
    if bits == 8:  # chunk j, lane r, byte i = u[r, 4j + i]
        payload = u.view(tiles, TILE_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 512)
    else:  # nibble group q, lane r, byte i = u[r, 8q + i] | u[r, 8q + 4 + i] << 4
        low = u & 0x0F
        halves = low.view(tiles, TILE_ROWS, blocks, 4, 2, 4)
        nibbles = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)
        chunks = u.view(tiles, TILE_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4)  # [tiles, blocks, j, r, i]
        planes = []
        for bit in range(4, bits):  # word bit 4r + i = byte (4r + i) // 8, bit (4r + i) % 8
            flags = ((chunks >> bit) & 1).reshape(tiles, blocks, 8, 8, 8)
            plane = flags[..., 0].clone()
            for k in range(1, 8):
                plane |= flags[..., k] << k
            planes.append(plane.reshape(tiles, blocks, 64))
        payload = torch.cat([nibbles, *planes], dim=-1)
    return torch.cat([header, payload], dim=-1).reshape(-1).contiguous()


def pack_blocks(weight: QuantizedWeight | tuple[QuantizedWeight, ...], ops=None) -> PackedBlocks:
    """A weight, or a weight's row parts in their own formats, in csrc/block_matmul.cpp's tiles.
    ops: the block kernel's extension, whose block_pack writes the same bytes as pack_affine
    (~10x faster); None: pack_affine."""
    parts = weight if isinstance(weight, tuple) else (weight,)
    datas, segments, offset = [], [], 0
    for part in parts:
        size = 0
        for start in range(0, part.shape[0], PACK_ROWS):  # a few MB of intermediates at a time
            rows = QuantizedWeight(part.format, (min(PACK_ROWS, part.shape[0] - start), part.shape[1]),
                                   part.data[start:start + PACK_ROWS], None)
            blocks = affine_blocks(rows)
            if ops is None:
                datas.append(pack_affine(blocks.d, blocks.c, blocks.u, blocks.group, blocks.bits))
            else:
                u = blocks.u.reshape(rows.shape[0], -1)
                datas.append(ops.block_pack(blocks.d, blocks.c, u, blocks.bits, blocks.group))
            size += datas[-1].numel()
        segments.append((part.shape[0], blocks.bits, blocks.group, offset))
        offset += size
    shape = (sum(part.shape[0] for part in parts), parts[0].shape[1])
    return PackedBlocks(torch.cat(datas) if len(datas) > 1 else datas[0],
                        torch.tensor(segments, dtype=torch.int64).reshape(-1, 4), shape)


def unpack_reference(packed: PackedBlocks) -> torch.Tensor:
    """float32 [out, in] from the tiles alone: the layout's test (it must equal the weight's
    dequantization, up to the fp16 rounding of d and c)."""
    out, inp = packed.shape
    blocks, rows = inp // BLOCK, []
    for n, bits, group, offset in packed.segments.tolist():
        groups, tiles = BLOCK // group, -(-n // TILE_ROWS)
        size = tiles * blocks * record_bytes(bits, group)
        records = packed.data[offset:offset + size].view(tiles, blocks, record_bytes(bits, group))
        header = records[..., :64 * groups].contiguous().view(torch.float16).float()
        header = header.view(tiles, blocks, groups, 2, TILE_ROWS)
        payload = records[..., 64 * groups:]
        if bits == 8:
            u = payload.reshape(tiles, blocks, 8, TILE_ROWS, 4).permute(0, 1, 3, 2, 4).reshape(tiles, blocks, TILE_ROWS, 32)
        else:
            nibbles = payload[..., :256].reshape(tiles, blocks, 4, TILE_ROWS, 4).permute(0, 1, 3, 2, 4)
            u = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-2).reshape(tiles, blocks, TILE_ROWS, 32).to(torch.int32)
            for p in range(bits - 4):
                plane = payload[..., 256 + 64 * p:256 + 64 * (p + 1)].reshape(tiles, blocks, 8, 8)
                flags = (plane[..., None].to(torch.int32) >> torch.arange(8)) & 1  # [tiles, blocks, j, byte, bit]
                flags = flags.reshape(tiles, blocks, 8, TILE_ROWS, 4).permute(0, 1, 3, 2, 4).reshape(tiles, blocks, TILE_ROWS, 32)
                u = u | (flags << (4 + p))
        d = header[:, :, :, 0].permute(0, 1, 3, 2).repeat_interleave(group, dim=-1)  # [tiles, blocks, 16, 32]
        c = header[:, :, :, 1].permute(0, 1, 3, 2).repeat_interleave(group, dim=-1)
        w = d * u.float() + c
        rows.append(w.permute(0, 2, 1, 3).reshape(tiles * TILE_ROWS, inp)[:n])
    return torch.cat(rows)
