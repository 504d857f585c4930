"""GGUF files: the config comes from transformers' GGUF conversion, the tensors are
dequantized one by one with the `gguf` package and renamed to Hugging Face names.

llama.cpp permutes the rows of q/k weights of the "llama" architecture (for its
interleaved rope); they are permuted back exactly as transformers does.
"""
from __future__ import annotations

import re
from typing import Any, Iterator

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Precomputed rope factors; transformers ignores them too (the config carries the scaling).
_SKIPPED = {"rope_freqs.weight"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def load_gguf_config(path: str) -> Any:
    """The transformers config of a GGUF file, as transformers itself builds it."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config_dict = dict(load_gguf_checkpoint(path, return_tensors=False)["config"])
    config_dict.pop("_model_name_or_path", None)
    return AutoConfig.for_model(**config_dict)


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor (None: skip it); unknown names raise."""
    if gguf_name in _SKIPPED:
        return None
    match = _BLOCK.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' _reverse_permute_weights)."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


class GGUFWeights:
    """Opens the file once; `len()` counts tensors, iteration yields (HF name, float32 tensor)."""

    def __init__(self, path: str, hf_config: Any):
        from gguf import GGUFReader

        self.reader = GGUFReader(path)
        self.config = hf_config
        arch = self.reader.get_field("general.architecture")
        self.architecture = arch.contents() if arch is not None else None

    def __len__(self) -> int:
        return len(self.reader.tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is None:
                continue
            weights = dequantize(tensor.data, tensor.tensor_type)
            weights = self._unpermute(tensor.name, weights)
            yield name, torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))

    def _unpermute(self, gguf_name: str, weights: np.ndarray) -> np.ndarray:
        if self.architecture != "llama":
            return weights
        if ".attn_q." in gguf_name:
            return unpermute_rows(weights, self.config.num_attention_heads)
        if ".attn_k." in gguf_name:
            return unpermute_rows(weights, self.config.num_key_value_heads)
        return weights
