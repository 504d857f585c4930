"""Linear and embedding layers whose parameters are allocated, not initialised:
weights are always loaded (or filled with dummy values) afterwards, so building a
model under `with torch.device(...)` costs no random init.

Fused layers (`MergedLinear`) stack several checkpoint tensors along the output
dim; `load_shard` copies one of them into its slice. Under tensor parallelism a layer
holds a `Slice` of the checkpoint tensor (rows: column-parallel, columns: row-parallel;
core/layers/parallel.py) and its loaders read only that slice of the checkpoint tensor,
which may be a lazy one (`CheckpointTensor`: the loader's safetensors slices).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           single_row_matvec: bool | None = None) -> torch.Tensor:
    """F.linear, except that a single row may go through matrix-vector multiplication.

    Which one is faster depends on the CPU and the torch build: on a Xeon with AMX,
    bf16 GEMM with M=1 was 2-3x slower than bf16 GEMV (lm_head of SmolLM2 4.4 ms vs
    1.3 ms, torch 2.13); on an AVX-512 EPYC without AMX it is the other way round
    (1.8 ms vs 4.0 ms). `single_row_matvec`: True/False as a backend measured it for
    this weight; None = matvec for reduced-precision weights (the AMX measurement)."""
    if x.shape[0] == 1 and x.dim() == 2:
        if single_row_matvec is None:
            single_row_matvec = x.dtype in (torch.bfloat16, torch.float16)
        if single_row_matvec:
            out = torch.mv(weight, x[0]).unsqueeze(0)
            return out if bias is None else out + bias
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class Slice:
    """The part [start, start + size) of a checkpoint dimension of length `full` that this
    shard holds; rows past `full` (vocabulary padding of the last shard) are zeros."""
    start: int
    size: int
    full: int

    @classmethod
    def whole(cls, size: int) -> Slice:
        return cls(0, size, size)


class CheckpointTensor(Protocol):
    """A checkpoint tensor, read or not yet read: torch.Tensor, or the loader's lazy
    safetensors slice (core/loader/safetensors_weights.py), which reads only what is narrowed."""

    @property
    def shape(self) -> torch.Size: ...
    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def read_slice(tensor: CheckpointTensor, dim: int, part: Slice, offset: int | None = None) -> torch.Tensor:
    """`part` of `tensor` along `dim`, zero-padded past the part's end (`part.full`). offset:
    where the part starts along `dim` when the tensor fuses several parts (None: the tensor
    is exactly the part)."""
    dim = dim % len(tensor.shape)
    exact = offset is None
    offset = offset or 0
    if tensor.shape[dim] < offset + part.full or (exact and tensor.shape[dim] != part.full):
        raise ValueError(f"checkpoint tensor has {tensor.shape[dim]} along dim {dim}, expected {part.full}")
    available = max(0, min(part.size, part.full - part.start))
    if available == part.size:
        return tensor.narrow(dim, offset + part.start, part.size)
    shape = list(tensor.shape)
    shape[dim] = part.size - available
    head = tensor.narrow(dim, offset + part.start, available)
    return torch.cat([head, torch.zeros(shape, dtype=head.dtype, device=head.device)], dim)


def _copy(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    if tensor.shape != target.shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def _empty_param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """in_features / out_features: this shard's sizes. rows / cols: which slice of the
    checkpoint's [out, in] weight they are (None: all of it). A row-parallel layer on a
    rank other than 0 is built with bias=False and bias_elsewhere=True: rank 0 holds the
    bias, so it is added once to the sum, and this shard skips the checkpoint's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, rows: Slice | None = None, cols: Slice | None = None,
                 bias_elsewhere: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype)
        self.bias = _empty_param(out_features, dtype=dtype) if bias else None
        self.rows, self.cols, self.bias_elsewhere = rows, cols, bias_elsewhere
        # How a single row is multiplied (see `linear`); a backend may set it per layer.
        self.single_row_matvec: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.single_row_matvec)

    def load(self, param_name: str, tensor: CheckpointTensor) -> bool:
        """Copy this shard's slice of checkpoint tensor `param_name` ("weight" / "bias");
        False when the tensor is not held here (a bias held by rank 0)."""
        if param_name not in ("weight", "bias"):
            raise ValueError(f"checkpoint has a linear {param_name!r}")
        if param_name == "bias" and self.bias is None and self.bias_elsewhere:
            return False
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} this layer does not have")
        if self.rows is not None:
            tensor = read_slice(tensor, 0, self.rows)
        if self.cols is not None and param_name == "weight":
            tensor = read_slice(tensor, 1, self.cols)
        _copy(param_name, param.data, read_whole(tensor))
        return True


def read_whole(tensor: CheckpointTensor) -> torch.Tensor:
    """A whole checkpoint tensor (a lazy one is read)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.narrow(0, 0, tensor.shape[0])


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim
    (q/k/v, gate/up): one matmul instead of several."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 dtype: torch.dtype | None = None, parts: Sequence[Slice] | None = None):
        """output_sizes: this shard's size of each part; parts: which rows of each part's
        checkpoint tensor they are (None: all of them)."""
        super().__init__(in_features, sum(output_sizes), bias, dtype)
        self.output_sizes = tuple(output_sizes)
        self.parts = tuple(parts) if parts is not None else tuple(Slice.whole(n) for n in self.output_sizes)
        if tuple(p.size for p in self.parts) != self.output_sizes:
            raise ValueError(f"parts {self.parts} do not match output sizes {self.output_sizes}")

    def load_shard(self, param: nn.Parameter, shard: int, tensor: CheckpointTensor) -> None:
        """Part `shard` (e.g. 1 = k of q/k/v) from its own checkpoint tensor."""
        start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
        _copy(f"shard {shard}", param.data.narrow(0, start, size), read_slice(tensor, 0, self.parts[shard]))

    def load(self, param_name: str, tensor: CheckpointTensor) -> bool:
        """Every part from one checkpoint tensor that already fuses them (Phi-3's qkv_proj)."""
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} this layer does not have")
        full = sum(p.full for p in self.parts)
        if tensor.shape[0] != full:
            raise ValueError(f"fused {param_name} has {tensor.shape[0]} rows, expected {full}")
        offset = 0
        for shard, part in enumerate(self.parts):
            start = sum(self.output_sizes[:shard])
            _copy(f"part {shard}", param.data.narrow(0, start, part.size), read_slice(tensor, 0, part, offset))
            offset += part.full
        return True


class Embedding(nn.Module):
    """rows: this shard's rows of the vocabulary (None: all; see parallel.VocabParallelEmbedding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None,
                 rows: Slice | None = None):
        super().__init__()
        self.rows = rows
        self.weight = _empty_param(num_embeddings if rows is None else rows.size, embedding_dim, dtype=dtype)

    def load(self, param_name: str, tensor: CheckpointTensor) -> bool:
        if param_name != "weight":
            raise ValueError(f"checkpoint has an embedding {param_name}")
        tensor = read_whole(tensor) if self.rows is None else read_slice(tensor, 0, self.rows)
        _copy("embedding", self.weight.data, tensor)
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
