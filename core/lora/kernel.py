"""The reference LoRA kernel: plain torch, one token at a time.

Each token's delta is its own pair of vector-matrix products, so it depends only on its own row
and its adapter, whatever else shares the step (a batched matmul rounds differently with the
number of rows beside it): what every backend's kernel is checked against
(core/testing/backend_contract.py), and what a backend without its own kernel may declare. It is
slow; the backends' kernels (backends/cpu/lora.py, backends/cuda/kernels/lora.py) are not."""
from __future__ import annotations

import torch

from ..backend_contract import LoraBatch, LoraKernel


class TorchLoraKernel(LoraKernel):
    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        h = x.new_zeros((x.shape[0], a.shape[1]))
        for start, stop, slot in batch.segments:
            weight = a[slot].float()
            for t in range(start, stop):
                h[t] = torch.mv(weight, x[t].float()).to(h.dtype)
        return h

    def expand(self, y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
               batch: LoraBatch) -> None:
        for start, stop, slot in batch.segments:
            weight, scale = b[slot].float(), scales[slot].float()
            for t in range(start, stop):
                y[t] += (torch.mv(weight, h[t].float()) * scale).to(y.dtype)
