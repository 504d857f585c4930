"""Model implementations and the choice between them.

Native pure-torch code (MODEL_TYPES) is picked by the Hugging Face config's
model_type; any other `AutoModelForCausalLM` architecture runs through the
transformers fallback (transformers_fallback.py) at lower speed; everything else is
refused with one line naming the model and what is supported (UnsupportedModelError).
`ModelConfig.model_impl` ("auto" | "native" | "transformers", `--model-impl`) forces a path.

A model served for embeddings (core/pooling/decide.py) takes native code only, from
EMBEDDING_TYPES: the Llama-family decoders without their output head (decoder_embedding.py)
and the encoders (bert.py: BERT, RoBERTa, XLM-R; modernbert.py: ModernBERT), which serve
nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .bert import BertEmbeddingModel
from .decoder_embedding import LlamaEmbeddingModel
from .gemma import GemmaForCausalLM
from .gemma3_vision import Gemma3ForConditionalGeneration
from .idefics3 import Idefics3ForConditionalGeneration
from .errors import UnsupportedModelError
from .llama import KernelFactory, LlamaForCausalLM, attention_specs
from .modernbert import ModernBertEmbeddingModel
from .moe import MoeForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from .sharding import check_shardable
from ..pooling.spec import PoolingSpec

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
    "idefics3": Idefics3ForConditionalGeneration,  # images in, text out (core/multimodal)
    "smolvlm": Idefics3ForConditionalGeneration,
    "gemma3": Gemma3ForConditionalGeneration,  # bidirectional image tokens (core/multimodal/image_rows.py)
    "qwen2_vl": Qwen2VLForConditionalGeneration,  # M-RoPE (core/multimodal/positions.py)
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
}
MODEL_IMPLS = ("auto", "native", "transformers")
# model_type -> the class that serves it for embeddings; the encoders serve nothing else
ENCODER_TYPES: dict[str, type[nn.Module]] = {
    "bert": BertEmbeddingModel,
    "roberta": BertEmbeddingModel,
    "xlm-roberta": BertEmbeddingModel,
    "modernbert": ModernBertEmbeddingModel,
}
EMBEDDING_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaEmbeddingModel,
    "mistral": LlamaEmbeddingModel,
    "qwen2": LlamaEmbeddingModel,
    "qwen3": LlamaEmbeddingModel,
    **ENCODER_TYPES,
}


@dataclass(frozen=True)
class ModelChoice:
    """Which path a model takes."""
    impl: str  # "native" | "transformers"
    model_class: type[nn.Module]
    model_type: str
    architecture: str  # the checkpoint's class name (config.architectures[0]) or its model_type
    pooling: PoolingSpec | None = None  # served for embeddings (core/pooling/decide.py); None: generation

    def describe(self) -> str:
        served = "" if self.pooling is None else f", {self.pooling.describe()}"
        if self.impl == "native":
            return f"{self.architecture} ({self.model_type}): native ({self.model_class.__name__}){served}"
        return (f"{self.architecture} ({self.model_type}): transformers fallback "
                "(transformers' modules, our paged attention)")


def supported_summary() -> str:
    return (f"native: {', '.join(sorted(MODEL_TYPES))}; through the transformers fallback: any other "
            "transformers AutoModelForCausalLM architecture whose class supports custom attention functions")


def _causal_lm_types() -> dict[str, Any]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def needs_remote_code(hf_config: Any) -> bool:
    """True when only the checkpoint's own code (config.auto_map) can build the model."""
    auto_map = getattr(hf_config, "auto_map", None) or {}
    return "AutoModelForCausalLM" in auto_map and getattr(hf_config, "model_type", None) not in _causal_lm_types()


def _fallback_refusal(hf_config: Any, trust_remote_code: bool) -> str | None:
    """Why the transformers fallback cannot run this config (None: it can)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = getattr(hf_config, "model_type", None)
    if getattr(hf_config, "is_encoder_decoder", False):
        return "is an encoder-decoder model"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(hf_config, "is_decoder", False):
        return "is an encoder-only model"
    if needs_remote_code(hf_config):
        return None if trust_remote_code else "needs the checkpoint's own code (pass --trust-remote-code to run it)"
    if model_type not in _causal_lm_types():
        return "is not a causal language model transformers knows (no AutoModelForCausalLM class)"
    if not getattr(_causal_lm_class(model_type), "_supports_attention_backend", False):
        return ("has a transformers class that does not support custom attention functions, so the "
                "transformers fallback cannot page its KV cache")
    return None


def _causal_lm_class(model_type: str) -> Any:
    import transformers

    return getattr(transformers, _causal_lm_types()[model_type], None)


def architecture_name(hf_config: Any) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    return architectures[0] if architectures else str(getattr(hf_config, "model_type", None))


def is_encoder(hf_config: Any) -> bool:
    """Whether the model is an encoder this engine serves (for embeddings only)."""
    return str(getattr(hf_config, "model_type", None)) in ENCODER_TYPES


def select_model(hf_config: Any, model_impl: str = "auto", trust_remote_code: bool = False,
                 pooling: PoolingSpec | None = None) -> ModelChoice:
    """auto: native when the model_type has native code, else the transformers fallback
    when it can run the config, else UnsupportedModelError (one line). With `pooling` (served
    for embeddings): the native class of EMBEDDING_TYPES, or UnsupportedModelError."""
    from .transformers_fallback import TransformersForCausalLM

    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    model_type = str(getattr(hf_config, "model_type", None))
    name = architecture_name(hf_config)
    if pooling is not None:
        if model_type not in EMBEDDING_TYPES or model_impl == "transformers":
            raise UnsupportedModelError(f"model {name} ({model_type}) cannot be served for embeddings: Switchyard "
                                        f"embeds with native code for {', '.join(sorted(EMBEDDING_TYPES))}")
        return ModelChoice("native", EMBEDDING_TYPES[model_type], model_type, name, pooling)
    if model_impl != "transformers" and model_type in MODEL_TYPES:
        return ModelChoice("native", MODEL_TYPES[model_type], model_type, name)
    if model_impl == "native":
        raise UnsupportedModelError(f"model {name} ({model_type}) has no native code (native: "
                                    f"{', '.join(sorted(MODEL_TYPES))}); use --model-impl auto or transformers")
    refusal = _fallback_refusal(hf_config, trust_remote_code)
    if refusal is not None:
        raise UnsupportedModelError(f"model {name} ({model_type}) {refusal}; Switchyard runs causal language "
                                    f"models: {supported_summary()}")
    return ModelChoice("transformers", TransformersForCausalLM, model_type, name)


def model_class(hf_config: Any) -> type[nn.Module]:
    return select_model(hf_config).model_class


__all__ = ["BertEmbeddingModel", "EMBEDDING_TYPES", "ENCODER_TYPES", "LlamaEmbeddingModel", "is_encoder",
           "ModernBertEmbeddingModel", "GemmaForCausalLM", "KernelFactory", "LlamaForCausalLM", "MODEL_IMPLS",
           "MODEL_TYPES", "ModelChoice", "UnsupportedModelError", "attention_specs", "check_shardable", "model_class",
           "needs_remote_code", "select_model", "supported_summary"]
