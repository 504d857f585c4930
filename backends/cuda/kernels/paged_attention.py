"""Launcher of the paged attention kernel: one launch for a ragged batch of
decodes and prompt chunks (causal over each request's cached prefix plus its new
tokens), with grouped-query heads, sliding window and logit soft-capping.

Everything the grid depends on is a shape or a Python bound the caller fixes
(`max_query_len`, `num_kv_splits`): no `.item()`, no host sync, so a decode step
can be captured in a CUDA graph and replayed with new metadata tensors.

A quantized cache (its dtype int8, float8_e4m3fn or float8_e5m2, --kv-cache-dtype) is passed as
bytes, and again as float32 words for its rows' scales; KV_FORMATS gives the kernel its format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from switchyard.core.backend import KV_SCALE_BYTES

from .attention_tiles import combine_splits_kernel, paged_attention_kernel

MAX_KV_SPLITS = 64
PROGRAMS_PER_SM = 4  # flash-decoding target: enough programs in flight to saturate HBM
MIN_DOT_SIZE = 16  # tl.dot needs every dimension >= 16 on GPUs
# A quantized cache's dtype -> the kernel's KV_FORMAT (attention_tiles._code_values); 0 = values.
KV_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


@dataclass(frozen=True)
class TileShape:
    block_m: int  # query rows (token, head of the group) per program
    block_q: int  # query tokens per program: block_m // group
    tile_n: int  # keys per inner step
    num_warps: int = 4
    num_stages: int = 2


def tile_shape(group: int, max_query_len: int) -> TileShape:
    """Decode-only batches get the smallest row tile that holds one token's group of
    heads; batches with prompt chunks get taller tiles (more reuse of each K/V tile)."""
    rows_needed = group * max(1, max_query_len)
    block_m = max(MIN_DOT_SIZE, triton.next_power_of_2(group), min(64, triton.next_power_of_2(rows_needed)))
    return TileShape(block_m=block_m, block_q=max(1, block_m // group), tile_n=64)


def choose_num_kv_splits(num_requests: int, num_kv_heads: int, max_query_len: int, num_sms: int) -> int:
    """Flash-decoding splits (a power of two) for decode-only batches too small to
    fill the device: up to PROGRAMS_PER_SM programs per SM. Depends only on static sizes."""
    programs = num_requests * num_kv_heads
    if max_query_len != 1 or programs == 0 or programs >= num_sms:
        return 1
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    return min(MAX_KV_SPLITS, 1 << (wanted.bit_length() - 1))  # the largest power of two <= wanted


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, *, scale: float, max_query_len: int,
                    sliding_window: int | None = None, soft_cap: float | None = None, num_kv_splits: int = 1,
                    out: torch.Tensor | None = None, window_anchors: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, num_heads, head_dim] (head dim contiguous) -> [T, num_heads, head_dim].

    query_start_loc [B + 1] int32, seq_lens [B] int32 (context length after this
    step), block_table [B, max_blocks] int32. `max_query_len` bounds every request's
    query length; 1 selects the decode-only path (grid = B programs per KV head, no
    search). `num_kv_splits` (power of two, decode-only) splits each request's keys
    across programs. `out` may be given to write into a fixed buffer (graphs). `window_anchors`
    [B] int32 (AttentionMetadata.window_anchors): where each request's window counts back from.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_requests = seq_lens.shape[0]
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    _check_shapes(query, kv_cache, num_kv_splits)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_requests == 0:
        return out
    group = num_heads // num_kv_heads
    tiles = tile_shape(group, max_query_len)
    decode_only = max_query_len == 1
    num_splits = num_kv_splits if decode_only else 1
    if decode_only:
        num_row_tiles = num_requests
    else:
        num_row_tiles = num_tokens // tiles.block_q + num_requests
    partials = _partial_buffers(num_tokens, num_heads, head_dim, num_splits, query.device)
    use_anchors = window_anchors is not None and sliding_window is not None
    anchors = window_anchors if use_anchors else seq_lens  # a pointer the kernel never reads without them
    kv_format = KV_FORMATS.get(kv_cache.dtype, 0)
    if kv_format:  # bytes, and the same bytes as float32 words (the rows' scales)
        kv_cache = kv_cache.view(torch.uint8)
        scales = kv_cache.view(torch.float32)
    else:
        scales = kv_cache
    paged_attention_kernel[(num_row_tiles, num_kv_heads, num_splits)](
        out, query, kv_cache, scales, block_table, seq_lens, query_start_loc, anchors, *partials,
        num_requests, num_heads, scale, 1.0 if soft_cap is None else soft_cap,
        0 if sliding_window is None else sliding_window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=tiles.tile_n, BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_q,
        DECODE_ONLY=decode_only, NUM_SPLITS=num_splits, USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=soft_cap is not None, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=query.device.type == "cpu", KV_FORMAT=kv_format, USE_ANCHORS=use_anchors,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    if num_splits > 1:
        combine_splits_kernel[(num_requests, num_heads)](
            out, *partials, query_start_loc, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits)
    return out


def _check_shapes(query: torch.Tensor, kv_cache: torch.Tensor, num_kv_splits: int) -> None:
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_dim = kv_cache.shape[3:]
    row = head_dim + (KV_SCALE_BYTES if kv_cache.dtype in KV_FORMATS else 0)
    if cache_dim != row or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs the head dimension contiguous in query and kv_cache")
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1) or num_kv_splits > MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits must be a power of two in [1, {MAX_KV_SPLITS}], got {num_kv_splits}")


def _partial_buffers(num_tokens: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device):
    """Unnormalised outputs, running maxima and sums of each split (tiny dummies without splits)."""
    if num_splits == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=device)
        return dummy, dummy, dummy
    rows = (num_tokens, num_heads, num_splits)
    return (torch.empty(*rows, head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))
