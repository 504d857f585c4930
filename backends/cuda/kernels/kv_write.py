"""Scatter new keys and values into the paged KV cache (one program per token).

Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(0 = keys, 1 = values). A slot is `block * block_size + offset`; a negative slot
means "skip this row", so padded rows of a captured CUDA graph write nothing.

A quantized cache (--kv-cache-dtype int8, fp8_e4m3fn, fp8_e5m2: its dtype is the code's) takes
the rows of core/kv/quantized.py's quantize_rows (head_dim codes and a float32 scale, as bytes:
torch ops, no host sync, so a graph captures them), scattered by the same kernel as bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from switchyard.core.kv.quantized import is_quantized, quantize_rows


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
                     stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                     stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads_to_write = NUM_KV_HEADS * (slot >= 0).to(tl.int32)  # 0 for a skipped row
    mask = (heads[:, None] < heads_to_write) & (dims[None, :] < HEAD_DIM)
    slot = tl.maximum(slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cache_block + offset * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
                    mask=mask)
    element = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + dst, key.to(element), mask=mask)
    tl.store(cache_ptr + stride_cache_kv + dst, value.to(element), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, num_kv_heads, head_dim] (last dim contiguous, any token/head
    stride); slot_mapping [>= T] int32/int64, negative = skip. Casts to the cache dtype, or
    quantizes into a quantized cache."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    if is_quantized(kv_cache):  # its rows, as bytes
        key, value = quantize_rows(key, kv_cache.dtype), quantize_rows(value, kv_cache.dtype)
        kv_cache = kv_cache.view(torch.uint8)
    num_kv_heads, head_dim = key.shape[1:]
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("write_kv needs the head dimension contiguous in key, value and kv_cache")
    _, _, block_size, cache_heads, cache_dim = kv_cache.shape
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit cache "
                         f"{tuple(kv_cache.shape)}")
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim))
