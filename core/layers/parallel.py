"""Tensor parallelism for the native models, in the manner of gpt-fast: the model code stays
plain torch, each shard builds its layers at its own (smaller) sizes, loads its slices of
the checkpoint, and the few collectives sit at the block boundaries:

- column-parallel q/k/v and gate/up: each shard holds its rows of each fused part
  (`Slice` per part of a MergedLinear), no communication;
- row-parallel o_proj / down_proj: each shard holds its columns; the block's output is
  summed over the shards by one all-reduce (`TensorParallel.reduce`). The all-reduce stays
  outside the Linear, so a backend may still swap the Linear for its own (e.g. a packed one),
  and the bias is held by rank 0 only: it enters the sum exactly once;
- vocab-parallel embedding (`VocabParallelEmbedding`: masked lookup + all-reduce) and
  lm_head (each shard its vocabulary rows, full logits by `TensorParallel.gather_logits`).

`TensorParallel` names this shard and the communicator its collectives go through; with
world_size 1 (NO_TP) nothing calls the communicator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .linear import Embedding, Linear, MergedLinear, Slice


@dataclass(frozen=True)
class TensorParallel:
    """This shard's place among `world_size` shards and the collectives between them
    (a core.backend.Communicator; None only when world_size is 1)."""

    rank: int = 0
    world_size: int = 1
    communicator: Any = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")
        if self.world_size > 1 and self.communicator is None:
            raise ValueError("a sharded model needs a communicator")

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def split(self, size: int) -> Slice:
        """This shard's equal part of `size` (which the shard count divides: check_shardable)."""
        if size % self.world_size:
            raise ValueError(f"{size} does not split into {self.world_size} equal parts")
        part = size // self.world_size
        return Slice(self.rank * part, part, size)

    def padded_split(self, size: int) -> Slice:
        """ceil(size / world_size) rows for every shard; the last one's tail lies past
        `size` (padding: zero weights, logits cut off after the gather)."""
        part = -(-size // self.world_size)
        return Slice(self.rank * part, part, size)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the shards of a row-parallel output (identity unsharded)."""
        return self.communicator.all_reduce(partial) if self.sharded else partial

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, vocab slice] on each shard -> [N, vocab_size], shards in rank order."""
        if not self.sharded:
            return logits
        return self.communicator.all_gather(logits.contiguous(), -1)[:, :vocab_size]


NO_TP = TensorParallel()


def merged_column_parallel(in_features: int, output_sizes: tuple[int, ...], bias: bool, dtype: torch.dtype,
                           tp: TensorParallel, parts: tuple[Slice, ...] | None = None) -> MergedLinear:
    """Fused projections of which this shard holds `parts` (default: its padded_split of
    each; padding rows are zeros, so an MLP's padded units output silu(0) * 0 = 0)."""
    parts = parts if parts is not None else tuple(tp.padded_split(size) for size in output_sizes)
    return MergedLinear(in_features, tuple(p.size for p in parts), bias=bias, dtype=dtype, parts=parts)


def row_parallel(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 tp: TensorParallel) -> Linear:
    """This shard's columns of [out, in_features] (padded_split: an MLP width the shard
    count does not divide gets zero columns, matching the zero rows of its gate/up); its
    output is a partial sum for TensorParallel.reduce. The bias, if any, is rank 0's only."""
    if not tp.sharded:
        return Linear(in_features, out_features, bias=bias, dtype=dtype)
    cols = tp.padded_split(in_features)
    return Linear(cols.size, out_features, bias=bias and tp.rank == 0, dtype=dtype, cols=cols,
                  bias_elsewhere=bias and tp.rank > 0)


def parallel_lm_head(hidden_size: int, vocab_size: int, dtype: torch.dtype, tp: TensorParallel) -> Linear:
    """This shard's (padded) vocabulary rows of the output projection."""
    if not tp.sharded:
        return Linear(hidden_size, vocab_size, bias=False, dtype=dtype)
    rows = tp.padded_split(vocab_size)
    return Linear(hidden_size, rows.size, bias=False, dtype=dtype, rows=rows)


def parallel_embedding(vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallel) -> Embedding:
    return (VocabParallelEmbedding(vocab_size, hidden_size, tp, dtype=dtype) if tp.sharded
            else Embedding(vocab_size, hidden_size, dtype=dtype))


class VocabParallelEmbedding(Embedding):
    """This shard's rows of the embedding table (padded_split of the vocabulary): ids
    outside them look up zeros, and the all-reduce adds the one shard that holds each id.
    `scale` multiplies the rows (Gemma's sqrt(hidden_size); a 0-d tensor in the model dtype)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel,
                 dtype: torch.dtype | None = None, scale: torch.Tensor | None = None):
        rows = tp.padded_split(num_embeddings)
        super().__init__(num_embeddings, embedding_dim, dtype=dtype, rows=rows)
        self.tp = tp
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, size = self.rows.start, self.rows.size
        outside = (ids < start) | (ids >= start + size)
        local = torch.where(outside, 0, ids - start)
        out = super().forward(local)
        if self.scale is not None:
            out = out * self.scale
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.reduce(out)
