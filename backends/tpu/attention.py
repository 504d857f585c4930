"""Paged attention for XLA devices, in ops that keep every shape static.

XlaAttentionKernel (CPU PJRT, and any XLA device without a better kernel): every query token
gathers its request's whole block-table row (a static max-blocks bucket) and masks what lies
beyond its own position, so the graph depends only on the padded tensor shapes, never on
the step's lengths. Which request a token belongs to is computed on the device from
query_start_loc, so the metadata's host tuples are never read (graph_safe).

PallasAttentionKernel (a real TPU): torch_xla's ragged paged attention kernel
(torch_xla.experimental.custom_kernel.ragged_paged_attention), which takes the same ragged
batch and a page table directly.
"""
from __future__ import annotations

import torch

from switchyard.core.backend import AttentionKernel, AttentionMetadata

# Masked scores: a large finite negative, not -inf: a padding token (all of its keys masked)
# then gets a finite, discarded output instead of NaN.
MASKED = -1e30


def write_kv_indexed(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """One index_copy_ into the flat slot view (padding tokens carry slot 0, in reserved block 0)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat.index_copy_(1, slot_mapping, torch.stack([key, value]).to(kv_cache.dtype))


def token_layout(meta: AttentionMetadata, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index [T], position [T]) of every flat token, from device tensors only.
    Padding tokens past the last request get the last request row and a negative position."""
    starts = meta.query_start_loc.long()
    tokens = torch.arange(num_tokens, device=device)
    request = (tokens[:, None] >= starts[None, 1:]).sum(1).clamp(max=starts.shape[0] - 2)
    position = meta.seq_lens.long()[request] - (starts[request + 1] - tokens)
    return request, position


class XlaAttentionKernel(AttentionKernel):
    """Gather through the block table, mask, softmax: XLA-friendly static-shape attention."""

    graph_safe = True

    def write_kv(self, key, value, kv_cache, meta) -> None:
        write_kv_indexed(key, value, kv_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        spec = self.spec
        num_tokens, device = query.shape[0], query.device
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        request, position = token_layout(meta, num_tokens, device)
        table = meta.block_table.long()[request]  # [T, MB]
        max_keys = table.shape[1] * block_size
        slots = (table[:, :, None] * block_size + torch.arange(block_size, device=device)).reshape(num_tokens, max_keys)
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        keys = flat[0][slots].float()  # [T, K, Hkv, D]
        values = flat[1][slots].float()
        group = spec.num_heads // num_kv_heads
        q = query.float().view(num_tokens, num_kv_heads, group, head_dim)
        scores = torch.einsum("tngd,tknd->tngk", q, keys) * spec.scale
        if spec.soft_cap is not None:
            scores = spec.soft_cap * torch.tanh(scores / spec.soft_cap)
        key_pos = torch.arange(max_keys, device=device)[None, :]
        allowed = key_pos <= position[:, None]
        if spec.sliding_window is not None:
            allowed = allowed & (key_pos > position[:, None] - spec.sliding_window)
        scores = scores.masked_fill(~allowed[:, None, None, :], MASKED)
        out = torch.einsum("tngk,tknd->tngd", scores.softmax(-1), values)
        return out.reshape(num_tokens, spec.num_heads, head_dim).to(query.dtype)


class PallasAttentionKernel(XlaAttentionKernel):
    """torch_xla's ragged paged attention (Pallas, TPU v4+). Its page layout interleaves keys
    and values along the head axis ([pages, page_size, 2 * kv_heads, D]), unlike the contract's
    [2, blocks, block_size, kv_heads, D], so each call builds that view of the layer's cache
    (one copy per layer and step: the price of keeping the engine's single cache layout)."""

    def __init__(self, spec, use_kernel: bool = True):
        super().__init__(spec)
        self.use_kernel = use_kernel  # False: torch_xla's pure-torch path (correctness checks off TPU)

    def forward(self, query, kv_cache, meta):
        from torch_xla.experimental.custom_kernel import ragged_paged_attention

        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        pages = kv_cache.permute(1, 2, 3, 0, 4).reshape(num_blocks, block_size, 2 * num_kv_heads, head_dim)
        num_seqs = (meta.query_start_loc[1:] > meta.query_start_loc[:-1]).sum().to(torch.int32).reshape(1)
        return ragged_paged_attention(
            query, pages, meta.seq_lens.to(torch.int32), meta.block_table.to(torch.int32),
            meta.query_start_loc.to(torch.int32), num_seqs, sm_scale=self.spec.scale,
            sliding_window=self.spec.sliding_window, soft_cap=self.spec.soft_cap, use_kernel=self.use_kernel)
