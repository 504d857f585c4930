"""What transformers' GGUF loading does to a tensor's values after dequantizing it (its
"TensorProcessor" per GGUF architecture), without importing transformers where we can.

Most architectures have no processor: the values are used as read. Of those with one, the
architectures the native models serve need one of two transforms:
- "llama": llama.cpp's q/k row permutation undone (each head's rotary halves interleaved);
- "norm_offset" (gemma2, gemma3, nemotron): llama.cpp stores norm weights with the +1 of their
  (1 + w) scale folded in; 1 is taken off.
Any other architecture with a processor ("transformers") gets transformers' own class.

Which kind an architecture is needs transformers' table, so it is worked out when the file is
first indexed and kept in its index (gguf_index.py): a cached start imports no transformers.
tests/core/test_plain_load.py compares each transform with transformers' class.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

IDENTITY, LLAMA, NORM_OFFSET, TRANSFORMERS = "identity", "llama", "norm_offset", "transformers"
_OWN = {"llama": LLAMA, "gemma2": NORM_OFFSET, "gemma3": NORM_OFFSET, "nemotron": NORM_OFFSET}


def processor_kind(architecture: str | None) -> str:
    """IDENTITY, LLAMA, NORM_OFFSET or TRANSFORMERS: how transformers processes this
    architecture's tensors."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    if TENSOR_PROCESSORS.get(architecture, TensorProcessor) is TensorProcessor:
        return IDENTITY
    return _OWN.get(architecture, TRANSFORMERS)


def transformers_processor(architecture: str | None, hf_config: Any) -> Any:
    """transformers' TensorProcessor of a GGUF architecture (the identity one if it has none)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())


class Processed(NamedTuple):
    weights: np.ndarray
    name: str


class OwnProcessor:
    """The IDENTITY, LLAMA and NORM_OFFSET transforms, called as transformers' processors are."""

    def __init__(self, kind: str, config: dict[str, Any]):
        self.kind = kind
        self.num_heads = config.get("num_attention_heads")
        self.num_kv_heads = config.get("num_key_value_heads")

    def process(self, weights: np.ndarray, name: str, **_: Any) -> Processed:
        if self.kind == LLAMA and None not in (self.num_heads, self.num_kv_heads):
            if ".attn_q." in name:
                weights = unpermute(weights, self.num_heads)
            elif ".attn_k." in name:
                weights = unpermute(weights, self.num_kv_heads)
        elif self.kind == NORM_OFFSET and "norm.weight" in name:
            weights = weights - 1
        return Processed(weights, name)


def unpermute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation of a [heads * head_dim, ...] matrix."""
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def make_processor(kind: str, architecture: str | None, hf_config: Any) -> Any:
    """The processor of `kind`: ours, or transformers' class for TRANSFORMERS."""
    if kind == TRANSFORMERS:
        return transformers_processor(architecture, hf_config)
    return OwnProcessor(kind, hf_config.to_dict())
