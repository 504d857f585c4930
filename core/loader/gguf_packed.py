"""A GGUF file's weight matrices as QuantizedWeights, its blocks kept as the file has them
(`--quantize gguf`, the default for a GGUF file): nothing is dequantized that a kernel can
multiply directly. The blocks are read from the mapped file (a memmap), not copied: a backend
repacks them once, and the mapping is dropped with the weights.

Names and every other tensor come as in core/loader/gguf_weights.py (transformers' mapping and
processing, gguf_processors.py). The only processing a packed matrix needs is llama's q/k row
permutation (llama.cpp interleaves each head's rotary halves; transformers undoes it): blocks
run along the input dim, so whole rows permute. Architectures whose processor does anything
else to weight matrices load them dequantized, as do formats with no packed kernel (one logged
line per reason). Gemma's and Nemotron's processors change only norm vectors, so their
matrices pack.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Iterator

import numpy as np
import torch

from ..quant.weight import QuantizedWeight
from .gguf_processors import LLAMA, TRANSFORMERS, unpermute
from .gguf_weights import GGUFWeights, _float32_tensor

logger = logging.getLogger(__name__)

# ggml type name -> our format (core/quant/weight.py)
PACKED_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
                "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (the processor's, applied to row
    indices)."""
    return torch.from_numpy(unpermute(np.arange(num_rows), num_heads))


class GGUFPackedWeights(GGUFWeights):
    """Iteration yields (HF name, QuantizedWeight) for matrices in a PACKED_TYPES format and
    (HF name, float32 tensor) for everything else."""

    def __init__(self, path: str, hf_config: Any, index_dir: str | None = None):
        super().__init__(path, hf_config, index_dir)
        # ours (identity, llama's row permutation, norm vectors) leave a matrix's blocks packable
        self.packable = self.processor_kind != TRANSFORMERS
        if not self.packable:
            logger.warning("--quantize gguf: architecture %r transforms its weights on load; every tensor "
                           "is dequantized", self.architecture)
        self._reasons: set[str] = set()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        if not self.packable:
            yield from super().__iter__()
            return
        from gguf.quants import dequantize

        for tensor in self.tensors:
            name = self.names.get(tensor.name)
            if name is None:
                continue
            kind = tensor.tensor_type.name
            if len(tensor.shape) == 2 and kind in PACKED_TYPES:
                yield name, self._packed(tensor, PACKED_TYPES[kind])
                continue
            if len(tensor.shape) == 2 and kind not in ("F32", "F16", "BF16"):
                self._log_once(f"{kind} matrices have no packed kernel: dequantized")
            weights = dequantize(tensor.data, tensor.tensor_type)
            result = self.processor.process(weights=weights, name=tensor.name, tensor_key_mapping=self.names,
                                            parsed_parameters={"tensors": {}})
            yield name, _float32_tensor(result.weights)

    def _packed(self, tensor: Any, fmt: str) -> QuantizedWeight:
        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # ggml lists the contiguous dim first
        with warnings.catch_warnings():  # the mapping is read-only, and nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(tensor.data.view(np.uint8)).reshape(rows, -1)
        weight = QuantizedWeight(fmt, (rows, cols), data)
        heads = self._permuted_heads(tensor.name)
        return weight if heads is None else weight.rows(unpermute_rows(rows, heads))

    def _permuted_heads(self, name: str) -> int | None:
        if self.processor_kind != LLAMA:
            return None
        if ".attn_q." in name:
            return self.config.num_attention_heads
        if ".attn_k." in name:
            return getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        return None

    def _log_once(self, reason: str) -> None:
        if reason not in self._reasons:
            self._reasons.add(reason)
            logger.info("--quantize gguf: %s", reason)
