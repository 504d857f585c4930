"""Fused mixture-of-experts for CUDA (and ROCm's Triton), as vLLM's fused_moe does it:
the step's (token, expert) pairs are sorted by expert and each expert's run is padded
to a multiple of BLOCK_M (`moe_align_block_size`), so one tiled grouped GEMM serves
every expert in a single launch: a program takes one BLOCK_M run of pairs (one expert)
and one BLOCK_N slice of the output. Two launches per layer (gate_up, then down with
the routing weight), with the Triton SiLU-and-mul between them. No host sync: the
grid depends only on the pair count, so decode steps can be captured in CUDA graphs.

Same contract as core.layers.fused_moe.fused_experts (the plain-torch reference).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused import silu_and_mul


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """16 rows (tl.dot's minimum) when experts get few pairs each (decode), else 64."""
    return 16 if num_pairs <= 4 * num_experts else 64


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """topk_ids [T, k] -> (sorted_pairs [P], block_experts [P / block_m]).

    sorted_pairs lists the flat pair indices (token * k + slot) grouped by expert, each
    expert's run padded with the sentinel T*k up to a multiple of block_m; block_experts
    gives each run's expert, and num_experts for the unused blocks at the end. P is
    the worst case, T*k + num_experts * (block_m - 1) rounded up to block_m."""
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without a host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[experts_sorted]
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[(padded_ends - padded)[experts_sorted] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    return sorted_pairs, block_experts


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, block_experts_ptr,
                         num_pairs, num_experts, N, K, rows_per_a, stride_a, stride_be, stride_bn, stride_c,
                         MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair, n] = sum_k A[pair // rows_per_a, k] * B[expert, n, k] (* weight[pair])."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < num_experts:
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        a_rows = (pairs // rows_per_a).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + dims
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                        other=0.0)
            b = tl.load(b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + k[:, None],
                        mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)
            if UPCAST_DOT:  # the interpreter's dot multiplies bf16 bit patterns as integers
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
        out = c_ptr + pairs[:, None].to(tl.int64) * stride_c + cols[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def _grouped_gemm(a, b, out, weights, sorted_pairs, block_experts, rows_per_a: int, block_m: int) -> None:
    num_experts, n, k = b.shape
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("grouped GEMM operands need contiguous rows")
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, sorted_pairs, block_experts,
        out.shape[0], num_experts, n, k, rows_per_a, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        MUL_WEIGHT=weights is not None, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST_DOT=a.device.type == "cpu", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights / topk_ids [T, k] -> [T, H]
    (core.layers.fused_moe.fused_experts, within rounding)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    out = torch.empty(num_pairs, w2.shape[1], dtype=torch.float32, device=hidden.device)
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    block_m = choose_block_m(num_pairs, w13.shape[0])
    sorted_pairs, block_experts = moe_align_block_size(topk_ids, block_m, w13.shape[0])
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden.contiguous(), w13, gate_up, None, sorted_pairs, block_experts, top_k, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(silu_and_mul(gate_up), w2, out, weights, sorted_pairs, block_experts, 1, block_m)
    return out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)
