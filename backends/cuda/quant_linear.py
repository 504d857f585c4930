"""The contract of the CUDA backend's quantized linear modules (quant.py swaps them in): a core
Linear's forward (x [..., in] -> [..., out] in x's dtype, bias added), the act-order permutation
of x applied first, and whether a CUDA graph can hold the module (graphs.py reads `graph_safe`)."""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn


class CudaQuantLinear(nn.Module):
    """Subclasses implement `multiply(x [M, in]) -> [M, out]` over their packed weight."""

    graph_safe: ClassVar[bool] = True  # False: the module syncs with the host (no CUDA graph can hold it)
    kernel: str  # what multiplies (set by each subclass): the start log and extra_repr

    def __init__(self, out_features: int, in_features: int, fmt: str, bias: torch.Tensor | None,
                 input_order: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.out_features, self.in_features, self.format = out_features, in_features, fmt
        self.register_buffer("bias", None if bias is None else bias.to(device), persistent=False)
        # act-order weights (core/quant/hub): W's columns are sorted by group, so x's are put in that order
        self.register_buffer("input_order", None if input_order is None else input_order.to(device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.input_order is not None:
            rows = rows.index_select(1, self.input_order)
        out = self.multiply(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        order = ", act-order" if self.input_order is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format}{order}: {self.kernel}"
