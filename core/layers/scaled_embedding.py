"""Token embeddings multiplied by a constant (Gemma: sqrt(hidden_size)).

The constant is rounded to the model dtype before the product, as transformers does
(`embed_scale.to(weight.dtype)`): in bfloat16, sqrt(640) is 25.25, not 25.30."""
from __future__ import annotations

import torch

from .linear import Embedding


def embedding_scale(scale: float, dtype: torch.dtype | None) -> torch.Tensor:
    """A 0-d tensor on the build device (no host-to-device copy per step), rounded through
    float32 exactly as transformers rounds it."""
    return torch.tensor(scale, dtype=torch.float32).to(dtype or torch.float32)


class ScaledEmbedding(Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float, dtype: torch.dtype | None = None):
        super().__init__(num_embeddings, embedding_dim, dtype=dtype)
        self.register_buffer("scale", embedding_scale(scale, dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale
