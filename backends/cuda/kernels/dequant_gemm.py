"""Dequantize-GEMM for CUDA (and ROCm's Triton): y[M, N] = x[M, K] @ W^T, W [N, K] held as packed
codes with a scale and an offset per group (backends/cuda/packed_codes.py: w = d * u + c; 4-bit
codes 8 to an int32 word along K, 5/6/8-bit codes a byte each; groups of any size dividing K).

One program computes a BLOCK_M x BLOCK_N tile of y: for each BLOCK_K slice of K it loads x's
rows, the codes of BLOCK_N output columns (a 4-bit word is read by the 8 rows of K it holds, from
cache), unpacks and dequantizes them in registers (float32: u * d + c, rounded to x's dtype for the
tensor-core dot) and accumulates in float32; the float weight is never written. Where the group is
a multiple of BLOCK_K a slice lies in one group and its scales are one row of BLOCK_N values;
otherwise (q6_k's groups of 16) each row of the slice reads its own group's. Rows past M, columns
past N and a ragged last K slice are masked.

Decode (few rows): BLOCK_M is 16 (tl.dot's smallest), and K is split over SPLIT_K programs when the
output tiles alone would leave most of the GPU's multiprocessors idle; each split writes float32
partial sums to its own slice of a [SPLIT_K, M, N] buffer, summed after the kernel (no atomics: the
result is deterministic). No host sync: decode steps can be captured in CUDA graphs.

`dequant_gemm_reference` is the plain-torch definition the tests compare against.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..packed_codes import PackedCodes, dequantize_packed

MAX_SPLIT_K = 8


@dataclass(frozen=True)
class TilePlan:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) or compute units (ROCm) of `device`; 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_tiles(m: int, n: int, k: int, group: int, device: torch.device) -> TilePlan:
    """The tiles of one call: small-M (decode) tiles with K split to fill the GPU, larger tiles as
    M grows (prompt chunks, big batches). BLOCK_K divides the group where it can (one scale row per
    slice)."""
    if m <= 16:
        block_m, block_n, block_k, warps = 16, 64, 128, 4
    elif m <= 64:
        block_m, block_n, block_k, warps = 32 if m <= 32 else 64, 64, 64, 4
    else:
        block_m, block_n, block_k, warps = 64, 128, 64, 8
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    while group % block_k and block_k > 32:  # slices within one group where a slice of >= 32 fits one
        block_k //= 2
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split, target = 1, 2 * _multiprocessors(device)
    while split < MAX_SPLIT_K and tiles * split * 2 <= target and triton.cdiv(k, block_k) >= 4 * split:
        split *= 2
    return TilePlan(block_m, block_n, block_k, split, warps)


@triton.jit
def _dequant_gemm_kernel(x_ptr, codes_ptr, scales_ptr, offsets_ptr, out_ptr, M, N, K, stride_xm, stride_os,
                         stride_om, BITS: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[split, m, n] = sum over this split's K slices of x[m, k] * (d * u + c)[k, n]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    dims = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(split, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k = tile * BLOCK_K + dims
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_ok = k_ok[:, None] & col_ok[None, :]
        if BITS == 4:
            words = tl.load(codes_ptr + (k // 8)[:, None].to(tl.int64) * N + cols[None, :], mask=b_ok, other=0)
            u = (words >> ((k % 8) * 4)[:, None]) & 0xF
        else:
            u = tl.load(codes_ptr + k[:, None].to(tl.int64) * N + cols[None, :], mask=b_ok, other=0)
        if GROUP % BLOCK_K == 0:  # the slice lies in one group: one row of scales
            g = (tile * BLOCK_K) // GROUP
            d = tl.load(scales_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            c = tl.load(offsets_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        else:
            g = (k // GROUP)[:, None].to(tl.int64) * N + cols[None, :]
            d = tl.load(scales_ptr + g, mask=b_ok, other=0.0).to(tl.float32)
            c = tl.load(offsets_ptr + g, mask=b_ok, other=0.0).to(tl.float32)
        w = (u.to(tl.float32) * d + c).to(a.dtype)
        if UPCAST_DOT:  # the interpreter's dot multiplies bf16 bit patterns as integers
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    out = out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def dequant_gemm(x: torch.Tensor, packed: PackedCodes, plan: TilePlan | None = None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16) -> [M, N] in x's dtype, float32 accumulation.
    plan: the tiles (None: plan_tiles)."""
    n, k = packed.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"dequant_gemm takes x [M, {k}], not {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m = x.shape[0]
    plan = plan or plan_tiles(m, n, k, packed.group, x.device)
    if plan.split_k == 1:
        out = torch.empty((1, m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((plan.split_k, m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return out[0]
    grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), plan.split_k)
    _dequant_gemm_kernel[grid](
        x, packed.codes, packed.scales, packed.offsets, out, m, n, k, x.stride(0), out.stride(0), out.stride(1),
        BITS=packed.bits, GROUP=packed.group, SPLIT_K=plan.split_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST_DOT=x.device.type == "cpu",
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps)
    return out[0] if plan.split_k == 1 else out.sum(dim=0).to(x.dtype)


def dequant_gemm_reference(x: torch.Tensor, packed: PackedCodes) -> torch.Tensor:
    """The definition: x @ (d * u + c)^T in float32, in x's dtype."""
    return (x.float() @ dequantize_packed(packed).to(x.device).T).to(x.dtype)
