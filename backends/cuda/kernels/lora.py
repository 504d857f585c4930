"""The batched low-rank kernels of LoRA adapters (core/lora; core/backend_contract.py LoraKernel),
punica's BGMV as vLLM's Triton LoRA ops write it: one program per token and output tile, the
token's adapter looked up in `token_slots` on the device (slot -1: nothing loaded, nothing added).

shrink: grid (T, R / BLOCK_R); a program sums x[t] * A[s, r] over `in` in BLOCK_K chunks, a
[BLOCK_R, BLOCK_K] float32 accumulator folded once at the end. expand: grid (T, out / BLOCK_N);
a program folds B[s]'s [BLOCK_N, R] tile against h[t] in float32, scales, rounds the delta to y's
dtype and adds it (y's rows strided: a column slice of a fused projection's output).

The host tuples (LoraBatch.segments) are never read and the grid depends on T alone, so the
kernels have no host sync and a captured CUDA graph replays them with new slots. Block sizes
depend only on the layer's shape, never on T, so a token's sums run in the same order whatever
else is in the step: its output is the same alone as in any batch.

Prompt chunks of hundreds of tokens with one adapter would go faster as SGMV (tl.dot over a
segment's tokens); that wants a GPU to measure, so it is not here yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from switchyard.core.backend import LoraBatch, LoraKernel

SHRINK_BLOCK_K = 256
SHRINK_BLOCK_R = 16
EXPAND_BLOCK_N = 64
EXPAND_BLOCK_R = 64  # ranks folded at a time (a larger R loops)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, slots_ptr, K, R,
                   stride_x, stride_as, stride_ar, stride_ak, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    width = K * (slot >= 0).to(tl.int32)  # 0 for slot -1: nothing loaded
    rows = a_ptr + tl.maximum(slot, 0) * stride_as + ranks[:, None] * stride_ar
    rank_mask = ranks < R
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_mask = cols < width
        x = tl.load(x_ptr + token * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
        a = tl.load(rows + cols[None, :] * stride_ak, mask=rank_mask[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += a * x[None, :]
    h = tl.sum(acc, axis=1)  # zeros for slot -1
    tl.store(h_ptr + token * stride_h + ranks, h.to(h_ptr.dtype.element_ty), mask=ranks < R)


@triton.jit
def _expand_kernel(y_ptr, h_ptr, b_ptr, scales_ptr, slots_ptr, N, R,
                   stride_y, stride_h, stride_bs, stride_bn, stride_br,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    valid = (slot >= 0).to(tl.int32)
    slot = tl.maximum(slot, 0)
    out_mask = outs < N * valid  # nothing loaded or stored for slot -1
    rows = b_ptr + slot * stride_bs + outs[:, None] * stride_bn
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for start in range(0, R, BLOCK_R):
        ranks = start + tl.arange(0, BLOCK_R)
        rank_mask = ranks < R * valid
        h = tl.load(h_ptr + token * stride_h + ranks, mask=rank_mask, other=0.0).to(tl.float32)
        b = tl.load(rows + ranks[None, :] * stride_br, mask=out_mask[:, None] & rank_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += b * h[None, :]
    scale = tl.load(scales_ptr + slot).to(tl.float32)
    element = y_ptr.dtype.element_ty
    delta = (tl.sum(acc, axis=1) * scale).to(element)  # rounded to y's dtype, then added
    y = tl.load(y_ptr + token * stride_y + outs, mask=out_mask, other=0.0)
    tl.store(y_ptr + token * stride_y + outs, (y.to(tl.float32) + delta.to(tl.float32)).to(element), mask=out_mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], a [S, R, in] -> h [T, R] in x's dtype (zeros for slot -1)."""
    num_tokens, width = x.shape
    rank = a.shape[1]
    if a.shape[2] != width:
        raise ValueError(f"a {tuple(a.shape)} does not fit x {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    h = torch.empty((num_tokens, rank), dtype=x.dtype, device=x.device)
    if num_tokens and rank:
        block_r = min(SHRINK_BLOCK_R, triton.next_power_of_2(rank))
        block_k = min(SHRINK_BLOCK_K, triton.next_power_of_2(width))
        _shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
            x, a, h, token_slots, width, rank, x.stride(0), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
            BLOCK_R=block_r, BLOCK_K=block_k)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                token_slots: torch.Tensor) -> None:
    """y [T, out] (rows strided, columns contiguous) += scales[s] * h[t] @ b[s].T in place."""
    num_tokens, out = y.shape
    rank = h.shape[1]
    if b.shape[1:] != (out, rank) or h.shape[0] != num_tokens:
        raise ValueError(f"y {tuple(y.shape)}, h {tuple(h.shape)} and b {tuple(b.shape)} do not fit")
    if out > 1 and y.stride(1) != 1:
        raise ValueError("lora_expand needs y's columns contiguous")
    if num_tokens and out and rank:
        block_r = min(EXPAND_BLOCK_R, triton.next_power_of_2(rank))
        block_n = min(EXPAND_BLOCK_N, triton.next_power_of_2(out))
        _expand_kernel[(num_tokens, triton.cdiv(out, block_n))](
            y, h, b, scales, token_slots, out, rank, y.stride(0), h.stride(0), b.stride(0), b.stride(1), b.stride(2),
            BLOCK_N=block_n, BLOCK_R=block_r)


class TritonLoraKernel(LoraKernel):
    """The CUDA and ROCm backends' LoRA kernel: the Triton shrink and expand above."""

    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        return lora_shrink(x, a, batch.token_slots)

    def expand(self, y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
               batch: LoraBatch) -> None:
        if y.shape[1] > 1 and y.stride(1) != 1:  # not a column slice: through a contiguous copy
            dense = y.contiguous()
            lora_expand(dense, h, b, scales.float(), batch.token_slots)
            y.copy_(dense)
            return
        lora_expand(y, h, b, scales.float(), batch.token_slots)
