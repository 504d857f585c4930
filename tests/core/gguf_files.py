"""Tiny GGUF files written from tiny random transformers models, for the GGUF loader
tests: metadata under llama.cpp's keys, tensors under the GGUF names transformers maps
back (the inverse of `get_gguf_hf_weights_map`), with llama.cpp's own transforms applied
(the q/k row permutation of "llama", Gemma's norms stored as 1 + weight)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

# transformers model_type -> GGUF architecture
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3_text": "gemma3", "phi3": "phi3"}


def _metadata(writer: Any, config: Any, architecture: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    params = config.rope_parameters
    theta = params["full_attention"]["rope_theta"] if "full_attention" in params else params["rope_theta"]
    writer.add_rope_freq_base(theta)
    if architecture == "llama":
        writer.add_rope_dimension_count(head_dim)
    if architecture.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config.sliding_window)


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the loader undoes it)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _stored(hf_name: str, gguf_name: str, tensor: torch.Tensor, config: Any, architecture: str) -> np.ndarray:
    weights = tensor.detach().float().numpy().copy()
    if architecture == "llama" and ".attn_q." in gguf_name:
        return _llama_cpp_permute(weights, config.num_attention_heads)
    if architecture == "llama" and ".attn_k." in gguf_name:
        return _llama_cpp_permute(weights, config.num_key_value_heads)
    if architecture.startswith("gemma") and hf_name.endswith("norm.weight"):
        return weights + 1.0
    return weights


def write_gguf(hf_model: torch.nn.Module, path: str, pooling_type: int | None = None) -> None:
    """`hf_model` (float32, transformers) as a float32 GGUF file at `path`; `pooling_type`:
    llama.cpp's `{arch}.pooling_type` (1 mean, 2 cls, 3 last: an embedding file), None: not written."""
    from gguf import GGUFWriter
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    from switchyard.core.loader.gguf_processors import transformers_processor

    config = hf_model.config
    architecture = GGUF_ARCHITECTURES[config.model_type]
    to_hf = get_gguf_hf_weights_map(hf_model, transformers_processor(architecture, config))
    state = hf_model.state_dict()
    writer = GGUFWriter(path, architecture)
    _metadata(writer, config, architecture)
    if pooling_type is not None:
        from gguf import PoolingType

        writer.add_pooling_type(PoolingType(pooling_type))
    tied = getattr(config, "tie_word_embeddings", False)
    for gguf_name, hf_name in sorted(to_hf.items()):
        if hf_name not in state or (tied and hf_name == "lm_head.weight"):
            continue
        writer.add_tensor(gguf_name, _stored(hf_name, gguf_name, state[hf_name], config, architecture))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
