"""Linear and embedding layers whose parameters are allocated, not initialised:
weights are always loaded (or filled with dummy values) afterwards, so building a
model under `with torch.device(...)` costs no random init.

Fused layers (`MergedLinear`) stack several checkpoint tensors along the output
dim; `load_shard` copies one of them into its slice. Under tensor parallelism a layer
holds a `Slice` of the checkpoint tensor (rows: column-parallel, columns: row-parallel;
core/layers/parallel.py) and its loaders read only that slice of the checkpoint tensor,
which may be a lazy one (`CheckpointTensor`: the loader's safetensors slices).

A Linear or Embedding may instead be loaded with a `QuantizedWeight` (core/quant): it then
holds the packed bytes in `quantized`, its float `weight` shrinks to an empty tensor, and its
forward dequantizes (the plain-torch reference; a backend's prepare_model swaps in a kernel).
Quantized weights are whole: tensor parallelism refuses --quantize (core/capabilities.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.parts import QuantizedParts
from ..quant.weight import QuantizedWeight, dequantize_rows

logger = logging.getLogger(__name__)


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
        # set instead of `weight` (hold_quantized); QuantizedParts: a fused weight's parts in their formats
        self.quantized: QuantizedWeight | QuantizedParts | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            order = getattr(self.quantized, "input_order", None)  # act-order: W's columns sorted by group
            return F.linear(x if order is None else x.index_select(-1, order), self.quantized.dequantize(x.dtype),
                            self.bias)
        return linear(x, self.weight, self.bias, self.single_row_matvec)

    def hold_quantized(self, weight: QuantizedWeight | QuantizedParts, free_float: bool = True) -> None:
        """Keep `weight` instead of the float one; free_float: empty the float parameter (False
        when another module still reads it, e.g. the embedding a head is tied to)."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {weight.shape} does not fit ({self.out_features}, {self.in_features})")
        self.quantized = weight
        if free_float:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def tie_quantized(self, embedding: Embedding) -> None:
        """A head tied to `embedding` shares its quantized weight too (their float one is shared)."""
        if embedding.quantized is not None:
            self.hold_quantized(embedding.quantized)

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
        if isinstance(tensor, QuantizedWeight):
            self.hold_quantized(_whole_quantized(tensor, self.rows, self.cols))
            return True
        if self.rows is not None:
            tensor = read_slice(tensor, 0, self.rows)
        if self.cols is not None and param_name == "weight":
            tensor = read_slice(tensor, 1, self.cols)
        _copy(param_name, param.data, read_whole(tensor))
        return True


def _whole_quantized(weight: QuantizedWeight, *slices: Slice | None) -> QuantizedWeight:
    if any(part is not None and part != Slice.whole(part.full) for part in slices):
        raise ValueError("a quantized weight cannot be split over shards")
    return weight


def float_weight(weight: QuantizedWeight | QuantizedParts, dtype: torch.dtype) -> torch.Tensor:
    """The float weight in the checkpoint's column order (an act-order weight's columns put back)."""
    dense, order = weight.dequantize(dtype), getattr(weight, "input_order", None)
    return dense if order is None else torch.empty_like(dense).index_copy_(1, order, dense)


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
        self._quantized_parts: dict[int, QuantizedWeight] = {}  # until every part has come
        self._float_parts = False  # a part came as floats: every part is kept as floats

    def load_shard(self, param: nn.Parameter, shard: int, tensor: CheckpointTensor) -> None:
        """Part `shard` (e.g. 1 = k of q/k/v) from its own checkpoint tensor. Quantized parts
        are joined into one quantized weight once all have come (QuantizedParts where their
        formats differ); once a part comes as floats, every part is dequantized into `weight`."""
        start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
        if isinstance(tensor, QuantizedWeight) and param is self.weight and not self._float_parts:
            self._quantized_parts[shard] = _whole_quantized(tensor, self.parts[shard])
            if len(self._quantized_parts) == len(self.output_sizes):
                self._join_quantized_parts()
            return
        if param is self.weight and not self._float_parts:
            self._float_parts = True
            self._dequantize_parts()
        if isinstance(tensor, QuantizedWeight):
            tensor = float_weight(tensor, param.dtype)
        _copy(f"shard {shard}", param.data.narrow(0, start, size), read_slice(tensor, 0, self.parts[shard]))

    def _join_quantized_parts(self) -> None:
        parts = [self._quantized_parts[i] for i in range(len(self.output_sizes))]
        orders = [part.input_order for part in parts]
        if any(o is not None for o in orders) and (len({p.format for p in parts}) > 1 or not all(
                o is not None and torch.equal(o, orders[0]) for o in orders)):
            logger.info("fused projection of act-order parts that differ in format or input order: dequantized")
            self._float_parts = True
            self._dequantize_parts()
            return
        if len({part.format for part in parts}) > 1:  # each part stays in its own format
            self._quantized_parts = {}
            self.hold_quantized(QuantizedParts(tuple(parts)))
            return
        scales = None if parts[0].scales is None else torch.cat([p.scales for p in parts])
        self._quantized_parts = {}
        self.hold_quantized(QuantizedWeight(parts[0].format, (self.out_features, self.in_features),
                                            torch.cat([p.data for p in parts]), scales, orders[0]))

    def _dequantize_parts(self) -> None:
        for shard, part in sorted(self._quantized_parts.items()):
            start = sum(self.output_sizes[:shard])
            self.weight.data.narrow(0, start, part.shape[0]).copy_(float_weight(part, self.weight.dtype))
        self._quantized_parts = {}

    def load(self, param_name: str, tensor: CheckpointTensor) -> bool:
        """Every part from one checkpoint tensor that already fuses them (Phi-3's qkv_proj)."""
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} this layer does not have")
        if isinstance(tensor, QuantizedWeight) and param is self.weight:
            self.hold_quantized(_whole_quantized(tensor, *self.parts))
            return True
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
        self.quantized: QuantizedWeight | None = None  # set instead of `weight` by a quantized load

    def load(self, param_name: str, tensor: CheckpointTensor) -> bool:
        if param_name != "weight":
            raise ValueError(f"checkpoint has an embedding {param_name}")
        if isinstance(tensor, QuantizedWeight):
            # kept as the loader hands it, e.g. a view of a mapped GGUF file: a lookup reads only
            # its rows' pages, which become resident as tokens are used (as llama.cpp's mapping);
            # the pages loading touched are dropped afterwards (core/memory.py)
            self.quantized = _whole_quantized(tensor, self.rows)
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
            return True
        tensor = read_whole(tensor) if self.rows is None else read_slice(tensor, 0, self.rows)
        _copy("embedding", self.weight.data, tensor)
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:  # only the looked-up rows are dequantized
            rows = dequantize_rows(self.quantized, ids.reshape(-1)).to(self.weight.dtype)
            return rows.view(*ids.shape, rows.shape[-1])
        return F.embedding(ids, self.weight)
