"""The one attention call site of every model: new keys/values go into the paged
KV cache through the backend kernel, then the kernel attends over the cached
prefix plus the new tokens."""
from __future__ import annotations

import torch
from torch import nn

from ..backend_contract import AttentionKernel, AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, kernel: AttentionKernel):
        super().__init__()
        self.kernel = kernel
        self.spec = kernel.spec

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """query [T, num_heads, head_dim], key/value [T, num_kv_heads, head_dim]
        (contiguous) -> [T, num_heads, head_dim]."""
        self.kernel.write_kv(key, value, kv_cache, meta)
        return self.kernel.forward(query, kv_cache, meta)
