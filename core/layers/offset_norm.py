"""Gemma's RMSNorm: the checkpoint stores `weight` with 1 taken off, the scale is
(1 + weight), and everything is computed in float32 before casting back, as in
transformers' Gemma2RMSNorm / Gemma3RMSNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class OffsetRMSNorm(nn.Module):
    """x [..., hidden] -> normalised x * (1 + weight), in x's dtype. A class of its own
    (not an RMSNorm subclass) so backends that swap RMSNorm for a fused kernel leave it be."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm without a weight is bit-identical to x * rsqrt(mean(x^2) + eps) in float32
        normalized = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normalized * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, scale=1+weight"
