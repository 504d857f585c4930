"""Pure-torch model implementations, picked by the Hugging Face config."""
from __future__ import annotations

from typing import Any

from torch import nn

from .gemma import GemmaForCausalLM
from .llama import KernelFactory, LlamaForCausalLM, attention_specs
from .moe import MoeForCausalLM
from .phi3 import Phi3ForCausalLM

# model_type -> class; GGUF-derived configs carry a model_type but no `architectures`.
MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "mixtral": MoeForCausalLM,
    "qwen2_moe": MoeForCausalLM,
    "qwen3_moe": MoeForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
}


def model_class(hf_config: Any) -> type[nn.Module]:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise NotImplementedError(
            f"model type {model_type!r} is not supported (supported: {', '.join(sorted(MODEL_TYPES))})")
    return MODEL_TYPES[model_type]


__all__ = ["GemmaForCausalLM", "KernelFactory", "LlamaForCausalLM", "MODEL_TYPES", "attention_specs", "model_class"]
