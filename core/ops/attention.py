"""Plain-torch reference attention: the oracle every backend kernel is tested against."""
from __future__ import annotations

import torch

from ..backend_contract import AttentionKernel
from ..kv.quantized import dequantize_rows, is_quantized, write_rows


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """A quantized cache (its dtype a format's code) takes quantized rows (core/kv/quantized.py)."""
    if is_quantized(kv_cache):
        write_rows(key, value, kv_cache, slot_mapping.long())
        return
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0, slot_mapping] = key.to(kv_cache.dtype)
    flat[1, slot_mapping] = value.to(kv_cache.dtype)


def paged_attention_reference(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: list[int],
                              seq_lens: list[int], block_table: torch.Tensor, scale: float,
                              sliding_window: int | None = None,
                              soft_cap: float | None = None,
                              window_anchors: list[int] | None = None) -> torch.Tensor:
    """query [T, H, D]; one request at a time, in float32, straight from the definition. A quantized
    cache is read as its rows' values (code * scale, core/kv/quantized.py). `window_anchors`
    (AttentionMetadata.window_anchors_cpu): where a request's window counts back from; a query's
    own position where None or seq_len - 1."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    quantized = is_quantized(kv_cache)
    cache = kv_cache.view(torch.uint8) if quantized else kv_cache
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q = query[start:end].float()  # [q_len, H, D]
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[i, :num_blocks].long()
        k, v = cache[0, blocks], cache[1, blocks]
        if quantized:
            k, v = dequantize_rows(k, kv_cache.dtype), dequantize_rows(v, kv_cache.dtype)
        k = k.reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = v.reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            shift = 0 if window_anchors is None else window_anchors[i] - (seq_len - 1)
            allowed &= k_pos > q_pos + shift - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


class ReferenceAttentionKernel(AttentionKernel):
    """The reference ops behind the AttentionKernel interface (slow; for tests and
    for backends that want correctness before speed)."""

    def write_kv(self, key, value, kv_cache, meta) -> None:
        write_kv_reference(key, value, kv_cache, meta.slot_mapping)

    def forward(self, query, kv_cache, meta):
        return paged_attention_reference(query, kv_cache, list(meta.query_start_loc_cpu), list(meta.seq_lens_cpu),
                                         meta.block_table, self.spec.scale, self.spec.sliding_window,
                                         self.spec.soft_cap, meta.window_anchors_cpu)
