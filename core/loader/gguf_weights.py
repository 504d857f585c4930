"""GGUF files: the config, the tensor names and the tensor values all come the way
transformers' own GGUF loading makes them, so a GGUF loads here for every architecture
transformers can load from GGUF, and its tensors are bit-identical to transformers'.

- Config: transformers' GGUF metadata mapping (`load_gguf_checkpoint`).
- Names: transformers maps GGUF tensor names to Hugging Face ones from the state dict of
  the model it loads into (`get_gguf_hf_weights_map` over gguf-py's name table). We build
  that model class from the config on the meta device (no memory, no init) and ask the same.
- Values: each tensor is dequantized with the `gguf` package and processed as transformers'
  TensorProcessor of the architecture does (gguf_processors.py), e.g. llama.cpp's q/k row
  permutation of "llama" undone, Gemma's norm weights (stored by llama.cpp with the +1 of their
  (1 + w) scale folded in) taken back to Hugging Face's convention, MoE experts merged into one.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Iterator

import numpy as np
import torch

from ..engine.heartbeat import Heartbeat
from .gguf_header import GGUFHeader, SkippedArray, read_header
from .gguf_index import GGUFIndex, read_index, write_index
from .gguf_processors import make_processor, processor_kind, transformers_processor
from ..models.plain_config import transformers_config

logger = logging.getLogger(__name__)


def load_gguf_config(path: str) -> Any:
    """The transformers config of a GGUF file, as transformers itself builds it, with what llama.cpp
    derives from the file where transformers' reader leaves a class default (llama_cpp_derived);
    a vision-language model's text GGUF, which transformers' reader refuses (VISION_TEXT), as
    its text architecture (vision_text_config)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    header = read_header(path)
    if header.metadata.get("general.architecture") in VISION_TEXT:
        return vision_text_config(path, header)
    config_dict = dict(load_gguf_checkpoint(path, return_tensors=False)["config"])
    config_dict.pop("_model_name_or_path", None)
    return llama_cpp_derived(AutoConfig.for_model(**config_dict))


# llama.cpp architectures of a vision-language model's text GGUF (served with its --mmproj file,
# mmproj.py) that transformers' GGUF reader does not know -> the text architecture whose keys
# they hold (under their own prefix), as transformers' GGUF mapping names them. Qwen2-VL's and
# Qwen2.5-VL's text model is Qwen2's, with M-RoPE: rope.dimension_sections (t, h, w and a fourth
# band, 0) are the checkpoint's text_config mrope_section.
VISION_TEXT = {"qwen2vl": "qwen2"}
GGUF_ARCHITECTURE = "gguf_architecture"  # the config's key naming a VISION_TEXT file's architecture


def vision_text_config(path: str, header: GGUFHeader) -> Any:
    """The text model's transformers config of a VISION_TEXT GGUF (its `header`), under
    transformers' mapping of its text architecture: the architecture's keys, the tokenizer's
    special ids, the vocabulary's size, tied embeddings where the file has no output matrix,
    M-RoPE's sections as rope_parameters' mrope_section."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    metadata = header.metadata
    architecture = metadata["general.architecture"]
    text = VISION_TEXT[architecture]
    mappings = ((architecture, GGUF_CONFIG_MAPPING[text]), ("tokenizer", GGUF_CONFIG_MAPPING["tokenizer"]))
    config = {name: metadata[f"{prefix}.{key}"] for prefix, mapping in mappings for key, name in mapping.items()
              if name is not None and f"{prefix}.{key}" in metadata}
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and tokens is not None:
        config["vocab_size"] = tokens.length if isinstance(tokens, SkippedArray) else len(tokens)
    rope = {"rope_type": "default", "rope_theta": float(config.pop("rope_theta", 10000.0))}
    sections = metadata.get(f"{architecture}.rope.dimension_sections")
    if sections is not None:
        if any(sections[3:]):
            raise ValueError(f"GGUF file {os.path.basename(path)!r}: M-RoPE sections {sections} with a fourth band "
                             f"are not {architecture}'s")
        rope["mrope_section"] = [int(s) for s in sections[:3]]
    tied = "output.weight" not in header.tensor_names
    return AutoConfig.for_model(text, **config, rope_parameters=rope, tie_word_embeddings=tied,
                                **{GGUF_ARCHITECTURE: architecture})


def load_gguf_tokenizer(directory: str, gguf_file: str, config: Any) -> Any:
    """transformers' tokenizer of the GGUF `gguf_file` in `directory`, whose config is `config`:
    AutoTokenizer's, but for a VISION_TEXT file (AutoTokenizer reads the file's config with the
    reader that refuses it): its tokenizer.json pipeline as it is (PreTrainedTokenizerFast, the
    class AutoTokenizer gives a BPE GGUF's, as the pair's processor loads it)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vision_text = getattr(config, GGUF_ARCHITECTURE, None) in VISION_TEXT
    return (PreTrainedTokenizerFast if vision_text else AutoTokenizer).from_pretrained(directory, gguf_file=gguf_file)


# Gemma's query scale: the GGUF holds no key for it; llama.cpp (src/models/gemma2.cpp, gemma3.cpp)
# scales the 27B's queries (known by its layer count) by 1/sqrt(hidden / heads), as Google's
# configs do (query_pre_attn_scalar 144 for Gemma 2 27B, 168 for Gemma 3 27B), and every other
# size's by 1/sqrt(head_dim), 256 for all of them. transformers' reader leaves its class default,
# 256: right but for the 27Bs.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def llama_cpp_derived(config: Any) -> Any:
    """`config` (from a GGUF) with the values llama.cpp derives where the file has no key."""
    if _GEMMA_27B_LAYERS.get(getattr(config, "model_type", None)) == getattr(config, "num_hidden_layers", None):
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    return config


def gguf_to_hf_names(hf_config: Any, processor: Any) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, exactly as transformers maps them when it loads
    the file into AutoModelForCausalLM (built here on the meta device, only for its names)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(transformers_config(hf_config))
    return get_gguf_hf_weights_map(skeleton, processor)


def _float32_tensor(weights: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(weights, torch.Tensor):
        return weights.to(torch.float32)
    return torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))


class GGUFWeights:
    """Maps the file once; `len()` counts tensors, iteration yields (HF name, float32 tensor).
    GGUF tensors transformers has no name for (e.g. llama.cpp's precomputed rope_freqs) are
    skipped, as transformers skips them; a weight the model then lacks is reported by load_model.
    `index_dir` (the converted metadata's directory) keeps the tensor table and the names
    (gguf_index.py): a start that finds them there parses nothing."""

    def __init__(self, path: str, hf_config: Any, index_dir: str | None = None):
        self.config = hf_config
        index = read_index(index_dir, path) if index_dir is not None else None
        if index is None:
            index = self._parse(path, hf_config)
            if index_dir is not None:
                write_index(index_dir, path, index)
        self.architecture, self.names, self.tensors = index.architecture, index.names, index.tensors
        self.processor_kind = index.processor
        self.processor = make_processor(index.processor, self.architecture, hf_config)

    @staticmethod
    def _parse(path: str, hf_config: Any) -> GGUFIndex:
        from gguf import GGUFReader

        logger.info("indexing the tensors of %s (once: kept with its converted metadata)", os.path.basename(path))
        with Heartbeat(lambda s: logger.info("still indexing the tensors of %s (%.0f s)", os.path.basename(path), s)):
            reader = GGUFReader(path)
            field = reader.get_field("general.architecture")
            architecture = field.contents() if field is not None else None
            names = gguf_to_hf_names(hf_config, transformers_processor(architecture, hf_config))
        return GGUFIndex(architecture, processor_kind(architecture), names, list(reader.tensors))

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        # Processors that assemble one Hugging Face tensor from several GGUF tensors (MoE
        # experts) keep it here, as transformers' loader does; they are yielded at the end.
        assembled: dict[str, dict] = {"tensors": {}}
        for tensor in self.tensors:
            weights = dequantize(tensor.data, tensor.tensor_type)
            result = self.processor.process(weights=weights, name=tensor.name, tensor_key_mapping=self.names,
                                            parsed_parameters=assembled)
            if result.name is None:
                continue
            if result.name not in self.names:
                logger.debug("GGUF tensor %s has no Hugging Face name; skipped", result.name)
                continue
            yield self.names[result.name], _float32_tensor(result.weights)
        for name, tensor in assembled["tensors"].items():
            yield name, _float32_tensor(tensor)
