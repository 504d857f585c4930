"""The reference LoRA kernel: plain torch over a step's segments (SGMV's view of LoraBatch).

Each run of tokens with one adapter is one pair of small matmuls, so a token's delta depends
only on its own row and its adapter: what every backend's kernel is checked against
(core/testing/backend_contract.py), and what a backend without its own kernel may declare."""
from __future__ import annotations

import torch

from ..backend_contract import LoraBatch, LoraKernel


class TorchLoraKernel(LoraKernel):
    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        h = x.new_zeros((x.shape[0], a.shape[1]))
        for start, stop, slot in batch.segments:
            h[start:stop] = (x[start:stop].float() @ a[slot].float().t()).to(h.dtype)
        return h

    def expand(self, y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
               batch: LoraBatch) -> None:
        for start, stop, slot in batch.segments:
            delta = (h[start:stop].float() @ b[slot].float().t()) * scales[slot].float()
            y[start:stop] += delta.to(y.dtype)
