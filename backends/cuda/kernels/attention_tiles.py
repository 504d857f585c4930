"""Triton device code of the paged attention kernel (the launcher is paged_attention.py).

One program owns a tile of query rows of one request against one KV head: the
rows are (query token, query head of that KV group) pairs, so every K/V tile read
from the cache serves all query heads that share it (grouped-query attention).
It walks the request's key tiles through the block table with an online softmax
in float32 (log2 domain: exp2 with log2(e) folded into the scale). With
NUM_SPLITS > 1 (decode only) the key range is cut into NUM_SPLITS parts, each
program writes an unnormalised partial result and `_combine_splits_kernel`
merges them (flash-decoding).

With USE_ANCHORS (AttentionMetadata.window_anchors), a request's window counts back from its
anchor rather than from its last query's position: every row's window moves by anchor - (seq_len - 1)
(0 for a prompt chunk, by the metadata's contract; an image token's row back to its own position).

A quantized cache (KV_FORMAT > 0, --kv-cache-dtype: per token and KV head, head_dim one-byte
codes and a float32 scale, core/kv/quantized.py) is read as bytes: the codes are turned into
their values by integer and float16 bit moves (`_code_values`: no float8 instruction, so any GPU
and the interpreter run it; each value is exact in the query's dtype), the tile's scores are
multiplied by their keys' scales after the dot, and the values' scales are folded into the
softmax weights before the second dot.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# Running max of a row that has seen no key yet: finite, so exp2(m_old - m_new) is never nan.
EMPTY_MAX = tl.constexpr(-1.0e30)


@triton.jit
def _locate_tile(query_start_loc_ptr, num_requests, BLOCK_Q: tl.constexpr, DECODE_ONLY: tl.constexpr):
    """(request, first query token of this tile within the request). Request i owns
    tiles [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1), a superset of what it needs,
    so a grid of T // BLOCK_Q + B tiles covers every batch of T tokens and B requests."""
    tile = tl.program_id(0)
    if DECODE_ONLY:
        request = tile
        first_query = tile * 0
    else:
        low = tl.zeros([], dtype=tl.int32)
        high = num_requests + low
        while low < high:
            middle = (low + high) // 2
            first_tile = tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle
            if first_tile <= tile:
                low = middle + 1
            else:
                high = middle
        request = low - 1
        first_query = (tile - tl.load(query_start_loc_ptr + request) // BLOCK_Q - request) * BLOCK_Q
    return request, first_query


@triton.jit
def _key_tile_range(seq_len, context_len, first_query, last_query, sliding_window, window_shift, split,
                    TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Key tiles [begin, end) this program visits; query rows sit at positions
    context_len + [first_query, last_query], their windows' anchors window_shift further on."""
    key_end = tl.minimum(seq_len, context_len + last_query + 1)
    key_begin = 0
    if USE_WINDOW:
        key_begin = tl.maximum(context_len + first_query + window_shift - sliding_window + 1, 0)
    begin = key_begin // TILE_N
    end = tl.cdiv(key_end, TILE_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(end - begin, NUM_SPLITS)
        begin = tl.minimum(begin + split * per_split, end)
        end = tl.minimum(begin + per_split, end)
    return begin, end


@triton.jit
def _tanh(x):
    decay = tl.exp(-2.0 * tl.abs(x))  # never overflows
    magnitude = (1.0 - decay) / (1.0 + decay)
    return tl.where(x >= 0, magnitude, -magnitude)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """a @ b with float32 accumulation. UPCAST_DOT (the CPU interpreter, whose dot
    multiplies bfloat16 bit patterns as integers) multiplies the same rounded
    operands in float32 instead."""
    if UPCAST_DOT:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        product = tl.dot(a, b, input_precision=DOT_PRECISION)
    return product


@triton.jit
def _code_values(codes, KV_FORMAT: tl.constexpr):
    """One-byte codes (uint8) -> their float32 values: 1 int8, 2 float8_e4m3fn (its bits moved into
    a float16 2^8 smaller, subnormals included), 3 float8_e5m2 (float16's top byte)."""
    if KV_FORMAT == 1:
        values = codes.to(tl.int8, bitcast=True).to(tl.float32)
    elif KV_FORMAT == 2:
        bits = codes.to(tl.uint16)
        half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
        values = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        values = (codes.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    return values


@triton.jit
def _attend_key_tile(q, m_i, l_i, acc, cache_ptr, scale_ptr, block_row_ptr, key_start, seq_len, row_pos,
                     kv_head_offset, sliding_window, window_shift, scale, soft_cap, dims, stride_cache_kv,
                     stride_cache_block, stride_cache_slot, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     UPCAST_DOT: tl.constexpr, KV_FORMAT: tl.constexpr):
    """One online-softmax step over keys [key_start, key_start + TILE_N)."""
    key_pos = key_start + tl.arange(0, TILE_N)
    key_valid = key_pos < seq_len
    block_ids = tl.load(block_row_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    slots = block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot + kv_head_offset
    dim_valid = dims < HEAD_DIM
    k = tl.load(cache_ptr + slots[None, :] + dims[:, None], mask=key_valid[None, :] & dim_valid[:, None], other=0)
    v = tl.load(cache_ptr + stride_cache_kv + slots[:, None] + dims[None, :],
                mask=key_valid[:, None] & dim_valid[None, :], other=0)
    if KV_FORMAT != 0:  # codes; each row's float32 scale follows its HEAD_DIM bytes (4-aligned)
        k = _code_values(k, KV_FORMAT)
        v = _code_values(v, KV_FORMAT)
        key_scale = tl.load(scale_ptr + (slots + HEAD_DIM) // 4, mask=key_valid, other=0.0)
        value_scale = tl.load(scale_ptr + (stride_cache_kv + slots + HEAD_DIM) // 4, mask=key_valid, other=0.0)
    scores = _dot(q, k.to(q.dtype), DOT_PRECISION, UPCAST_DOT)
    if KV_FORMAT != 0:
        scores = scores * key_scale[None, :]
    if USE_SOFT_CAP:
        scores = soft_cap * _tanh(scores * (scale / soft_cap)) * LOG2E
    else:
        scores = scores * (scale * LOG2E)
    allowed = key_valid[None, :] & (key_pos[None, :] <= row_pos[:, None])
    if USE_WINDOW:
        allowed = allowed & (key_pos[None, :] > row_pos[:, None] + window_shift - sliding_window)
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_FORMAT != 0:
        p = p * value_scale[None, :]
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_PRECISION, UPCAST_DOT)
    return m_new, l_i, acc


@triton.jit
def _store_result(out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, acc, m_i, l_i, token, head, dims,
                  row_valid, split, num_heads, stride_out_token, stride_out_head,
                  HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
    if NUM_SPLITS == 1:
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        ptrs = out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
        tl.store(ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=mask)
        tl.store(partial_max_ptr + row, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + row, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_requests", "sliding_window"])
def paged_attention_kernel(out_ptr, query_ptr, cache_ptr, scale_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
                           window_anchors_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
                           num_requests, num_heads, scale, soft_cap, sliding_window,
                           stride_query_token, stride_query_head, stride_out_token, stride_out_head,
                           stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
                           stride_block_table,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_Q: tl.constexpr, DECODE_ONLY: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                           UPCAST_DOT: tl.constexpr, KV_FORMAT: tl.constexpr, USE_ANCHORS: tl.constexpr):
    request, first_query = _locate_tile(query_start_loc_ptr, num_requests, BLOCK_Q, DECODE_ONLY)
    if request >= num_requests:
        return
    q_start = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - q_start
    if first_query >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - q_len
    window_shift = seq_len * 0
    if USE_ANCHORS:
        window_shift = tl.load(window_anchors_ptr + request) - (seq_len - 1)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_query = first_query + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (row_query < q_len)
    row_pos = context_len + row_query
    token = (q_start + row_query).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, DIM_PAD)
    q = tl.load(query_ptr + token[:, None] * stride_query_token + head[:, None] * stride_query_head + dims[None, :],
                mask=row_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    last_query = tl.minimum(first_query + BLOCK_Q, q_len) - 1
    split = tl.program_id(2)
    begin, end = _key_tile_range(seq_len, context_len, first_query, last_query, sliding_window, window_shift, split,
                                 TILE_N, USE_WINDOW, NUM_SPLITS)
    m_i = tl.full([BLOCK_M], EMPTY_MAX, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    block_row_ptr = block_table_ptr + request.to(tl.int64) * stride_block_table
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
    for key_tile in range(begin, end):
        m_i, l_i, acc = _attend_key_tile(q, m_i, l_i, acc, cache_ptr, scale_ptr, block_row_ptr, key_tile * TILE_N,
                                         seq_len, row_pos, kv_head_offset, sliding_window, window_shift, scale,
                                         soft_cap, dims,
                                         stride_cache_kv, stride_cache_block, stride_cache_slot,
                                         BLOCK_SIZE, TILE_N, HEAD_DIM, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION,
                                         UPCAST_DOT, KV_FORMAT)
    _store_result(out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, acc, m_i, l_i, token, head, dims,
                  row_valid, split, num_heads, stride_out_token, stride_out_head, HEAD_DIM, NUM_SPLITS)


@triton.jit
def combine_splits_kernel(out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, query_start_loc_ptr,
                          num_heads, stride_out_token, stride_out_head,
                          HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Merge the NUM_SPLITS partial results of one (decode request, query head)."""
    request = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + request).to(tl.int64)
    if tl.load(query_start_loc_ptr + request + 1) == token:
        return  # a padding request without a query token
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DIM_PAD)
    row = (token * num_heads + head) * NUM_SPLITS + splits
    maxima = tl.load(partial_max_ptr + row)
    weights = tl.exp2(maxima - tl.max(maxima, axis=0))
    total = tl.sum(tl.load(partial_sum_ptr + row) * weights, axis=0)
    parts = tl.load(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=dims[None, :] < HEAD_DIM,
                    other=0.0)
    result = tl.sum(parts * weights[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims, result.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)
