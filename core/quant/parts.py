"""A weight whose row parts come in different quantized formats: a fused projection (q/k/v,
gate/up) whose checkpoint parts differ, as in llama.cpp's Q4_K_M mixes (q and k Q4_K, v Q6_K).
Kept as its parts instead of being dequantized; a backend packs each part in its own format."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .weight import QuantizedWeight


@dataclass(frozen=True)
class QuantizedParts:
    parts: tuple[QuantizedWeight, ...]  # row blocks, in output order; one input width

    def __post_init__(self):
        if len({part.shape[1] for part in self.parts}) != 1:
            raise ValueError("quantized parts must share their input width")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    @property
    def format(self) -> str:
        return "+".join(part.format for part in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] (the reference of every kernel)."""
        return torch.cat([part.dequantize(dtype) for part in self.parts])
