"""GeGLU: the gated GELU of Gemma's MLP (gate and up fused into one projection)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# transformers' activation name -> F.gelu's `approximate`
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GeluAndMul(nn.Module):
    """x = [gate, up] along the last dim -> gelu(gate) * up."""

    def __init__(self, activation: str = "gelu_pytorch_tanh"):
        super().__init__()
        if activation not in GELU_APPROXIMATIONS:
            raise NotImplementedError(f"activation {activation!r} is not supported "
                                      f"(supported: {', '.join(GELU_APPROXIMATIONS)})")
        self.approximate = GELU_APPROXIMATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
