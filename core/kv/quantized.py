"""The arithmetic of a quantized KV cache (--kv-cache-dtype int8, fp8_e4m3fn, fp8_e5m2) in plain
torch: what every backend's kernels compute, and the reference they are tested against.

The layout is the contract's (core/backend_contract.py KV_CACHE_FORMATS): for every token and KV
head, head_dim one-byte codes and then a float32 scale. One row is written (`quantize_rows`) as:

    amax  = max |x| over the row, in float32
    scale = amax / QMAX                      (0 for a row of zeros)
    codes = x * (QMAX / amax), as the format rounds it:
            int8: to the nearest integer (ties to even), clamped to [-127, 127];
            float8: clamped to [-QMAX, QMAX], then torch's conversion (nearest, ties to even)

and read (`dequantize_rows`) as code * scale in float32. The C++ kernels (backends/cpu/csrc/
kv_rows.h) write the same bytes; the Triton kernels take these rows from `quantize_rows` and
decode them in the kernel.

A row's codes depend on its own values alone, so a request's cache, and hence its tokens, do not
depend on what else is batched with it (batch invariance holds with a quantized cache). One
scale per row of head_dim values: the default model's 64 are two of llama.cpp's q8_0 blocks of
32, at the same 8.5 bits a value (64 codes and 4 scale bytes, against q8_0's 2 x (32 + 2)). The
scale is absmax, as q8_0's and vLLM's dynamic fp8 scales are: float8's range is used to its top,
and an outlier coordinate costs the rest of its row precision (e5m2 keeps 2 mantissa bits,
e4m3fn 3, int8 about 7 at the row's peak).
"""
from __future__ import annotations

import torch

from ..backend_contract import KV_CACHE_FORMATS, KV_SCALE_BYTES

# The largest code of each format: int8's symmetric range, float8's largest finite value.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
assert set(QMAX) == set(KV_CACHE_FORMATS.values())


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether a cache tensor holds quantized rows (its dtype is a format's code)."""
    return kv_cache.dtype in QMAX


def quantize_rows(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] (any float dtype) -> uint8 [..., D + KV_SCALE_BYTES]: the rows as the cache holds them."""
    qmax = QMAX[code_dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax / qmax
    # qmax / amax divided as written (torch's `number / tensor` multiplies by a reciprocal instead);
    # full_like, not a tensor made from the number: no host-to-device copy inside a CUDA graph
    scaled = x * torch.where(amax > 0, torch.full_like(amax, qmax) / amax, 0.0)
    if code_dtype == torch.int8:
        codes = scaled.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        codes = scaled.clamp(-qmax, qmax).to(code_dtype)
    return torch.cat([codes.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, code_dtype: torch.dtype, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rows [..., D + KV_SCALE_BYTES] (uint8, or the format's dtype) -> [..., D] in dtype."""
    raw = rows if rows.dtype == torch.uint8 else rows.view(torch.uint8)
    codes = raw[..., :-KV_SCALE_BYTES].view(code_dtype)
    scale = raw[..., -KV_SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)


def write_rows(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """key/value [T, Hkv, D] quantized into a quantized cache [2, blocks, block_size, Hkv, D + 4] at
    slots [T] (int64, none negative): the rows of quantize_rows, copied as bytes."""
    _, num_blocks, block_size, num_kv_heads, row = kv_cache.shape
    flat = kv_cache.view(torch.uint8).view(2, num_blocks * block_size, num_kv_heads, row)
    flat[0].index_copy_(0, slots, quantize_rows(key, kv_cache.dtype))
    flat[1].index_copy_(0, slots, quantize_rows(value, kv_cache.dtype))


def dequantize_cache(kv_cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A whole cache as values [2, blocks, block_size, Hkv, D] in dtype (a float cache: converted)."""
    if not is_quantized(kv_cache):
        return kv_cache.to(dtype)
    return dequantize_rows(kv_cache, kv_cache.dtype, dtype)
