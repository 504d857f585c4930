"""The tile layout csrc/block_matmul.cpp multiplies: a block-format weight (q4_0, q4_1, q5_0,
q5_1, q8_0, q4_k, q5_k, q6_k; core/quant/weight.py) repacked once at load, still 4 to 8 bits a
weight (never dequantized), so that one AVX512-VNNI instruction takes 4 weights of 16 output
rows at once (llama.cpp's CPU backend repacks its blocks the same way).

Every format is read as w = d * u + c with u unsigned of `bits` bits and (d, c) per `group`
weights (core's `affine_blocks`): (4, 32) for q4_0/q4_1/q4_k, (5, 32) for q5_0/q5_1/q5_k,
(6, 16) for q6_k, (8, 32) for q8_0. How (d, c) are stored is the format's scale scheme
(SCHEMES), each the file's own fields, so the tiles hold exactly the file's weights:
    DC (q4_1, q5_1): fp16 d and c per group.
    D (q4_0, q5_0, q8_0): fp16 d per group; c = -2^(bits-1) d (-8d, -16d, and -128d for q8_0's
      u = q + 128), derived in the kernel.
    K (q4_k, q5_k): per group the 6-bit sub-scale sc and sub-min mn (a byte each), per
      super-block of 256 weights (8 blocks) fp16 d_super and dmin_super; d = d_super * sc,
      c = -(dmin_super * mn).
    K6 (q6_k): per group of 16 the int8 sub-scale sc, per super-block fp16 d_super;
      d = d_super * sc, c = -32d.
The kernel forms d and c in float32, where every one of these products is exact (an fp16's
11-bit mantissa times at most 8 bits), so its (d, c) are core's to the bit.

Rows go in tiles of 16 (the last padded with zero rows). Tile t, block b (the 32 weights
32b..32b+31 of each of the tile's rows) is one record:
    header: the scheme's fields for the block, field-major, 16 rows each (field f of row r at
      byte (16f + r) * its size): DC per group g: fp16 d[16], fp16 c[16] (64 bytes a group);
      D: fp16 d[16] (32); K: uint8 sc[16], uint8 mn[16] (32); K6: int8 sc[16] per group (32)
    payload: 8 chunks j of 16 four-byte lanes, lane r of chunk j = row r's u of weights 4j..4j+3
      8 bits: the chunks themselves (512 bytes)
      4-6 bits: the low nibbles, chunk 2q and 2q+1 in the 64 bytes of nibble group q (byte i of
        lane r = u[r, 8q + i] & 15 | (u[r, 8q + 4 + i] & 15) << 4; 256 bytes), then one 64-byte
        plane per bit above 4: chunk j's 8 bytes are a 64-bit word whose bit 4r + i is that bit
        of u[r, 4j + i].
The records of a tile are contiguous; for K and K6 each super-block's scales (K: fp16
d_super[16], fp16 dmin_super[16], 64 bytes; K6: fp16 d_super[16], 32 bytes) come just before
its first record, so a tile is read front to back. Tile after tile. Bits a weight, all counted
(tile_bytes * 8 / weights): q4_0 4.5, q4_1 5, q5_0 5.5, q5_1 6, q8_0 8.5, q4_k 4.625, q5_k
5.625, q6_k 6.5625 (the file's: the same but q4_k 4.5 and q5_k 5.5, whose 6-bit scales take a
byte each here). A weight whose rows come in parts of different formats (a fused q/k/v of a
Q4_K_M file: q, k Q4_K, v Q6_K) is one segment per part, each padded to whole tiles, one after
the other; `segments` [S, 5] int64 says (rows, bits, group, scheme, byte offset) of each, and
the kernel writes each into its own output columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from switchyard.core.quant import BLOCK, BLOCK_BYTES, GROUP_BITS, QuantizedWeight, affine_blocks, scale_min_k4

from .pages import join_on_huge_pages

TILE_ROWS = 16
PACK_ROWS = 1024  # rows repacked at a time (a multiple of TILE_ROWS): bounds the transient memory
SUPER_BLOCKS = 8  # blocks of a k-quant super-block (256 weights)

# The scale schemes (csrc/block_matmul.h's kScheme*, the same numbers), and each format's.
SCHEME_DC, SCHEME_D, SCHEME_K, SCHEME_K6 = 0, 1, 2, 3
SCHEMES = {"q4_1": SCHEME_DC, "q5_1": SCHEME_DC, "q4_0": SCHEME_D, "q5_0": SCHEME_D, "q8_0": SCHEME_D,
           "q4_k": SCHEME_K, "q5_k": SCHEME_K, "q6_k": SCHEME_K6}
# (bits, group, scheme) the kernel multiplies
LAYOUTS = ((4, 32, SCHEME_DC), (5, 32, SCHEME_DC), (4, 32, SCHEME_D), (5, 32, SCHEME_D), (8, 32, SCHEME_D),
           (4, 32, SCHEME_K), (5, 32, SCHEME_K), (6, 16, SCHEME_K6))


# The sizes of a layout, in one place (block_matmul.h has the same functions).
def header_bytes(group: int, scheme: int) -> int:
    """A record's scale fields for its 16 rows."""
    return {SCHEME_DC: 64 * (BLOCK // group), SCHEME_D: 32 * (BLOCK // group)}.get(scheme, 32)


def super_bytes(scheme: int) -> int:
    """A super-block's scale fields for its 16 rows (k-quants), else 0."""
    return {SCHEME_K: 64, SCHEME_K6: 32}.get(scheme, 0)


def record_bytes(bits: int, group: int, scheme: int) -> int:
    return header_bytes(group, scheme) + (512 if bits == 8 else 256 + 64 * (bits - 4))


def tile_bytes(bits: int, group: int, scheme: int, blocks: int) -> int:
    """One tile of `blocks` blocks: its records and its super-blocks' scales."""
    return blocks * record_bytes(bits, group, scheme) + blocks // SUPER_BLOCKS * super_bytes(scheme)


def bits_per_weight(fmt: str) -> float:
    """What the tiles hold per weight of `fmt`, scales included."""
    group, bits = GROUP_BITS[fmt]
    return tile_bytes(bits, group, SCHEMES[fmt], SUPER_BLOCKS) * 8 / (SUPER_BLOCKS * BLOCK * TILE_ROWS)


@dataclass(frozen=True)
class PackedBlocks:
    """A repacked weight: `data` uint8 [bytes], `segments` int64 [S, 5] (rows, bits, group,
    scheme, byte offset); `shape` (out, in)."""

    data: torch.Tensor
    segments: torch.Tensor
    shape: tuple[int, int]


@dataclass(frozen=True)
class Fields:
    """One part's rows as the tiles store them: `head` [rows, in / 32, F] (fp16, uint8 or int8)
    the record header's fields of each row and block, `supers` [rows, in / 256, F'] fp16 those of
    each super-block (None but for K, K6), u uint8 [rows, in]."""

    head: torch.Tensor
    supers: torch.Tensor | None
    u: torch.Tensor
    bits: int
    group: int
    scheme: int


def scale_fields(weight: QuantizedWeight) -> Fields:
    """The weight's fields in its scale scheme, read from its blocks (u and the fp16 fields from
    core's affine_blocks; the k-quants' sub-scales and super-block scales from the file's bytes,
    as core reads them)."""
    fmt, (rows, inp) = weight.format, weight.shape
    scheme, blocks = SCHEMES[fmt], inp // BLOCK
    a = affine_blocks(weight)
    u, groups = a.u.reshape(rows, inp), BLOCK // a.group
    if scheme == SCHEME_DC:  # per group g: d, c (field 2g, 2g + 1)
        head = torch.stack([a.d, a.c], dim=-1).to(torch.float16).reshape(rows, blocks, 2 * groups)
        return Fields(head, None, u, a.bits, a.group, scheme)
    if scheme == SCHEME_D:
        return Fields(a.d.to(torch.float16).reshape(rows, blocks, groups), None, u, a.bits, a.group, scheme)
    b = weight.data.reshape(rows, inp // (SUPER_BLOCKS * BLOCK), BLOCK_BYTES[fmt])
    if scheme == SCHEME_K:  # d, dmin, 12 bytes of 6-bit scales and mins (core's _affine)
        sc, mn = scale_min_k4(b[..., 4:16])
        head = torch.stack([sc, mn], dim=-1).reshape(rows, blocks, 2)
        sup = b[..., 0:4].contiguous().view(torch.float16)  # [rows, supers, (d, dmin)]
    else:  # q6_k: 16 int8 scales at 192, fp16 d at 208
        head = b[..., 192:208].contiguous().view(torch.int8).reshape(rows, blocks, 2)
        sup = b[..., 208:210].contiguous().view(torch.float16)
    return Fields(head.contiguous(), sup.contiguous(), u, a.bits, a.group, scheme)


def _interleave(fields: torch.Tensor, tiles: int) -> torch.Tensor:
    """fields [tiles * 16 rows, n, F] -> uint8 [tiles, n, F * 16 * size]: field f of row r at
    byte (16 f + r) * size."""
    size, n, count = fields.element_size(), fields.shape[1], fields.shape[2]
    raw = fields.contiguous().view(torch.uint8).reshape(tiles, TILE_ROWS, n, count, size)
    return raw.permute(0, 2, 3, 1, 4).reshape(tiles, n, count * TILE_ROWS * size)


def pack_fields(f: Fields) -> torch.Tensor:
    """The tiles (see the module docstring) of one part; uint8 [tiles * tile bytes]."""
    if (f.bits, f.group, f.scheme) not in LAYOUTS:
        raise ValueError(f"no tile layout for {f.bits}-bit weights in groups of {f.group} (scheme {f.scheme})")
    out, inp = f.u.shape
    blocks = inp // BLOCK
    pad = -out % TILE_ROWS
    head, sup, u = f.head, f.supers, f.u
    if pad:  # zero rows: d = c = 0, so they add nothing (and are never stored)
        head = torch.nn.functional.pad(head, (0, 0, 0, 0, 0, pad))
        sup = None if sup is None else torch.nn.functional.pad(sup, (0, 0, 0, 0, 0, pad))
        u = torch.nn.functional.pad(u, (0, 0, 0, pad))
    tiles = (out + pad) // TILE_ROWS
    header = _interleave(head, tiles)
    u = u.reshape(tiles, TILE_ROWS, blocks, BLOCK)
    if f.bits == 8:  # chunk j, lane r, byte i = u[r, 4j + i]
        payload = u.view(tiles, TILE_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 512)
    else:  # nibble group q, lane r, byte i = u[r, 8q + i] | u[r, 8q + 4 + i] << 4
        low = u & 0x0F
        halves = low.view(tiles, TILE_ROWS, blocks, 4, 2, 4)
        nibbles = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)
        chunks = u.view(tiles, TILE_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4)  # [tiles, blocks, j, r, i]
        planes = []
        for bit in range(4, f.bits):  # word bit 4r + i = byte (4r + i) // 8, bit (4r + i) % 8
            flags = ((chunks >> bit) & 1).reshape(tiles, blocks, 8, 8, 8)
            plane = flags[..., 0].clone()
            for k in range(1, 8):
                plane |= flags[..., k] << k
            planes.append(plane.reshape(tiles, blocks, 64))
        payload = torch.cat([nibbles, *planes], dim=-1)
    records = torch.cat([header, payload], dim=-1)
    if sup is not None:  # each super-block's scales, then its 8 records
        supers = blocks // SUPER_BLOCKS
        records = torch.cat([_interleave(sup, tiles), records.reshape(tiles, supers, -1)], dim=-1)
    return records.reshape(-1).contiguous()


def pack_blocks(weight: QuantizedWeight | tuple[QuantizedWeight, ...], ops=None) -> PackedBlocks:
    """A weight, or a weight's row parts in their own formats, in csrc/block_matmul.cpp's tiles.
    ops: the block kernel's extension, whose block_pack writes the same bytes as pack_fields
    (~10x faster); None: pack_fields."""
    parts = weight if isinstance(weight, tuple) else (weight,)
    datas, segments, offset = [], [], 0
    for part in parts:
        size = 0
        for start in range(0, part.shape[0], PACK_ROWS):  # a few MB of intermediates at a time
            rows = QuantizedWeight(part.format, (min(PACK_ROWS, part.shape[0] - start), part.shape[1]),
                                   part.data[start:start + PACK_ROWS], None)
            f = scale_fields(rows)
            if ops is None:
                datas.append(pack_fields(f))
            else:
                sup = f.supers if f.supers is not None else torch.empty(0, dtype=torch.float16)
                datas.append(ops.block_pack(f.head, sup, f.u, f.bits, f.group, f.scheme))
            size += datas[-1].numel()
        segments.append((part.shape[0], f.bits, f.group, f.scheme, offset))
        offset += size
    shape = (sum(part.shape[0] for part in parts), parts[0].shape[1])
    return PackedBlocks(join_on_huge_pages(datas),  # read whole at every step (pages.py)
                        torch.tensor(segments, dtype=torch.int64).reshape(-1, 5), shape)


def unpack_reference(packed: PackedBlocks) -> torch.Tensor:
    """float32 [out, in] from the tiles alone, (d, c) formed as the kernel forms them: the
    layout's test (it must equal the weight's dequantization exactly)."""
    out, inp = packed.shape
    blocks, rows = inp // BLOCK, []
    for n, bits, group, scheme, offset in packed.segments.tolist():
        groups, tiles = BLOCK // group, -(-n // TILE_ROWS)
        record, extra = record_bytes(bits, group, scheme), super_bytes(scheme)
        data = packed.data[offset:offset + tiles * tile_bytes(bits, group, scheme, blocks)]
        if extra:
            supers = blocks // SUPER_BLOCKS
            data = data.view(tiles, supers, extra + SUPER_BLOCKS * record)
            sup = data[..., :extra].contiguous().view(torch.float16).float().view(tiles, supers, -1, TILE_ROWS)
            sup = sup.repeat_interleave(SUPER_BLOCKS, dim=1)  # [tiles, blocks, fields, 16]
            data = data[..., extra:]
        records = data.reshape(tiles, blocks, record)
        header, payload = records[..., :header_bytes(group, scheme)].contiguous(), records[..., header_bytes(group, scheme):]
        if scheme == SCHEME_DC:
            dc = header.view(torch.float16).float().view(tiles, blocks, groups, 2, TILE_ROWS)
            d, c = dc[:, :, :, 0], dc[:, :, :, 1]
        elif scheme == SCHEME_D:
            d = header.view(torch.float16).float().view(tiles, blocks, groups, TILE_ROWS)
            c = d * -float(2 ** (bits - 1))
        elif scheme == SCHEME_K:
            fields = header.view(tiles, blocks, 2, TILE_ROWS).float()
            d, c = (sup[:, :, 0] * fields[:, :, 0])[:, :, None], -(sup[:, :, 1] * fields[:, :, 1])[:, :, None]
        else:
            d = sup[:, :, :1] * header.view(torch.int8).view(tiles, blocks, groups, TILE_ROWS).float()
            c = d * -float(2 ** (bits - 1))
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
        d = d.permute(0, 1, 3, 2).repeat_interleave(group, dim=-1)  # [tiles, blocks, 16, 32]
        c = c.permute(0, 1, 3, 2).repeat_interleave(group, dim=-1)
        w = d * u.float() + c
        rows.append(w.permute(0, 2, 1, 3).reshape(tiles * TILE_ROWS, inp)[:n])
    return torch.cat(rows)
