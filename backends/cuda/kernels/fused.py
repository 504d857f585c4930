"""Fused elementwise kernels around attention and the MLP: RMSNorm (optionally
after a residual add), rotary embedding ("rotate half" layout) and SiLU-and-mul.
Each matches its plain-torch layer in core/layers within rounding: arithmetic in
float32, one cast back to the activation dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, residual_ptr, weight_ptr, hidden_size, eps,
                     stride_out, stride_x, stride_residual,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # residual <- x + residual, rounded like the unfused add
        element = residual_ptr.dtype.element_ty
        x = (x + tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(element)
        tl.store(residual_ptr + row * stride_residual + cols, x, mask=mask)
        x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    if ROUND_BEFORE_WEIGHT:  # Hugging Face: cast to the input dtype, then scale
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, hidden] -> RMSNorm(x) * weight, like core.layers.RMSNorm. With `residual`
    [T, hidden]: residual <- x + residual (in place), then returns
    (RMSNorm(residual) * weight, residual)."""
    num_rows, hidden_size = x.shape
    out = torch.empty((num_rows, hidden_size), dtype=x.dtype, device=x.device)
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)} with contiguous rows")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if num_rows:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_rows,)](
            out, x, x if residual is None else residual, weight, hidden_size, eps,
            out.stride(0), x.stride(0), x.stride(0) if residual is None else residual.stride(0),
            BLOCK=block, HAS_RESIDUAL=residual is not None, ROUND_BEFORE_WEIGHT=x.dtype != torch.float32,
            num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, residual)


@triton.jit
def _rotary_kernel(out_ptr, x_ptr, cos_ptr, sin_ptr, num_heads, stride_out_token, stride_out_head,
                   stride_x_token, stride_x_head, stride_cos_token, stride_sin_token,
                   HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, DIM_PAD)
    rolled = (dims + HEAD_DIM // 2) % HEAD_DIM  # roll(x, D/2): the partner of each dim
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    row = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head
    x = tl.load(row + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(row + rolled[None, :], mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cos_token + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin_token + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
    result = x * cos[None, :] + partner * sin[None, :]
    tl.store(out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
             result.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, heads, head_dim] (any token/head strides, e.g. a view of the fused qkv
    projection); cos / signed_sin [T, 1, head_dim] or [T, head_dim] from
    core.layers.RotaryEmbedding. Same result as core.layers.apply_rotary; `out=x`
    rotates in place."""
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2 or x.stride(-1) != 1:
        raise ValueError("apply_rotary needs an even, contiguous head dimension")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cos, signed_sin = cos.reshape(num_tokens, head_dim), signed_sin.reshape(num_tokens, head_dim)
    if cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    if num_tokens:
        block_heads = min(triton.next_power_of_2(num_heads), 16)
        _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_heads))](
            out, x, cos, signed_sin, num_heads, out.stride(0), out.stride(1), x.stride(0), x.stride(1),
            cos.stride(0), signed_sin.stride(0),
            HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_HEADS=block_heads)
    return out


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, intermediate_size, stride_out, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    result = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, result.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] = [gate, up] -> silu(gate) * up, [T, I] (core.layers.SiluAndMul)."""
    num_rows, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {width}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    intermediate_size = width // 2
    out = torch.empty((num_rows, intermediate_size), dtype=x.dtype, device=x.device)
    if num_rows and intermediate_size:
        block = min(SILU_BLOCK, triton.next_power_of_2(intermediate_size))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(intermediate_size, block))](
            out, x, intermediate_size, out.stride(0), x.stride(0), BLOCK=block)
    return out
