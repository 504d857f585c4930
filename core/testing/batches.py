"""Random paged attention steps for kernel tests, as the engine lays them out: a flat
ragged batch, decodes first, then prompt chunks whose requests may have cached prefixes,
over randomly placed (never contiguous, never block 0) cache blocks. No pytest here."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from ..backend import AttentionMetadata, AttentionSpec
from ..kv.quantized import quantize_rows
from ..ops.attention import paged_attention_reference, write_kv_reference


def ragged_lens(rng: random.Random, block_size: int) -> tuple[list[tuple[int, int]], int]:
    """(query_len, seq_len) per request and how many lead as decodes: 1-4 decodes over up to
    four blocks of context, 1-2 prompt chunks with or without a cached prefix, and one
    whole prompt with none."""
    decodes = [(1, rng.randint(1, 4 * block_size)) for _ in range(rng.randint(1, 4))]
    chunks = [(q, q + rng.choice([0, rng.randint(1, 2 * block_size)]))
              for q in (rng.randint(2, block_size + 5) for _ in range(rng.randint(1, 2)))]
    return decodes + chunks + [(7, 7)], len(decodes)


def make_meta(lens: list[tuple[int, int]], num_decodes: int, block_size: int, num_blocks: int,
              rng: random.Random, device: torch.device) -> AttentionMetadata:
    """The metadata of one step; block ids distinct across requests, random, never 0."""
    needed = [-(-seq_len // block_size) for _, seq_len in lens]
    ids = rng.sample(range(1, num_blocks), sum(needed))
    table = torch.zeros(len(lens), max(needed) + 1, dtype=torch.int32)  # a column of 0-padding
    slots, starts = [], [0]
    for row, ((q_len, seq_len), count) in enumerate(zip(lens, needed)):
        table[row, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
        slots += [int(table[row, pos // block_size]) * block_size + pos % block_size
                  for pos in range(seq_len - q_len, seq_len)]
        starts.append(starts[-1] + q_len)
    seq_lens = [s for _, s in lens]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), num_decodes=num_decodes,
        max_query_len=max(q for q, _ in lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(seq_lens))


@dataclass(frozen=True)
class AttentionStep:
    """One step's inputs, on the backend's device; `cache` holds random cached prefixes (and
    random values in every slot no request uses)."""

    spec: AttentionSpec
    meta: AttentionMetadata
    cache: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor

    def quantized(self, kv_cache_dtype: str) -> AttentionStep:
        """The same step over a quantized KV cache (--kv-cache-dtype): its spec says so, and its
        cache holds this step's cache rows quantized (core/kv/quantized.py)."""
        spec = replace(self.spec, kv_cache_dtype=kv_cache_dtype)
        cache = quantize_rows(self.cache, spec.cache_dtype).view(spec.cache_dtype)
        return replace(self, spec=spec, cache=cache)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the cache after the reference write, the reference attention output), on the CPU."""
        cache = self.cache.cpu().contiguous().clone()  # a backend's cache may have its own strides
        write_kv_reference(self.key.cpu(), self.value.cpu(), cache, self.meta.slot_mapping.cpu())
        out = paged_attention_reference(self.query.cpu(), cache, list(self.meta.query_start_loc_cpu),
                                        list(self.meta.seq_lens_cpu), self.meta.block_table.cpu(),
                                        self.spec.scale, self.spec.sliding_window, self.spec.soft_cap,
                                        self.meta.window_anchors_cpu)
        return cache, out


def random_step(spec: AttentionSpec, lens: list[tuple[int, int]], num_decodes: int, seed: int,
                device: torch.device, num_blocks: int = 48) -> AttentionStep:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    meta = make_meta(lens, num_decodes, spec.block_size, num_blocks, rng, device)
    num_tokens = meta.query_start_loc_cpu[-1]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(spec.dtype).to(device)

    cache = randn(2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return AttentionStep(spec, meta, cache, randn(num_tokens, spec.num_heads, spec.head_dim),
                         randn(num_tokens, spec.num_kv_heads, spec.head_dim),
                         randn(num_tokens, spec.num_kv_heads, spec.head_dim))


def image_rows_step(spec: AttentionSpec, seed: int, device: torch.device) -> AttentionStep:
    """A random step with window anchors (AttentionMetadata.window_anchors) as an image chunk's rows
    lay them out (core/multimodal/image_rows.py): positions 10-17 as decode rows, an image at 12-17
    whose rows see up to 17 (seq_len 18), each anchored at its own position; beside them a decode
    over four blocks and a prompt chunk, anchored at seq_len - 1. Its reference honours them."""
    decode = 4 * spec.block_size + 3
    lens = [(1, p + 1) if p < 12 else (1, 18) for p in range(10, 18)] + [(1, decode), (6, 20)]
    anchors = list(range(10, 18)) + [decode - 1, 19]
    step = random_step(spec, lens, len(lens) - 1, seed, device)
    return replace(step, meta=replace(step.meta, window_anchors=torch.tensor(anchors, dtype=torch.int32, device=device),
                                      window_anchors_cpu=tuple(anchors)))
