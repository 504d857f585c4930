"""Linear and embedding layers whose parameters are allocated, not initialised:
weights are always loaded (or filled with dummy values) afterwards, so building a
model under `with torch.device(...)` costs no random init.

Fused layers (`MergedLinear`) stack several checkpoint tensors along the output
dim; `load_shard` copies one of them into its slice. Tensor-parallel variants can
replace these classes from outside the model code.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           single_row_matvec: bool | None = None) -> torch.Tensor:
    """F.linear, except that a single row may go through matrix-vector multiplication.

    Which one is faster depends on the CPU and the torch build: on a Xeon with AMX,
    bf16 GEMM with M=1 was 2-3x slower than bf16 GEMV (lm_head of SmolLM2 4.4 ms vs
    1.3 ms, torch 2.13); on an AVX-512 EPYC without AMX it is the other way round
    (1.8 ms vs 4.0 ms). `single_row_matvec`: True/False as a backend measured it for
    this weight; None = matvec for reduced-precision weights (the AMX measurement)."""
    if x.shape[0] == 1 and x.dim() == 2:
        if single_row_matvec is None:
            single_row_matvec = x.dtype in (torch.bfloat16, torch.float16)
        if single_row_matvec:
            out = torch.mv(weight, x[0]).unsqueeze(0)
            return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def _empty_param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype)
        self.bias = _empty_param(out_features, dtype=dtype) if bias else None
        # How a single row is multiplied (see `linear`); a backend may set it per layer.
        self.single_row_matvec: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.single_row_matvec)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim
    (q/k/v, gate/up): one matmul instead of several."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(output_sizes), bias, dtype)
        self.output_sizes = tuple(output_sizes)

    def load_shard(self, param: nn.Parameter, shard: int, tensor: torch.Tensor) -> None:
        start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
        target = param.data.narrow(0, start, size)
        if tensor.shape != target.shape:
            raise ValueError(f"shard {shard} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = _empty_param(num_embeddings, embedding_dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
