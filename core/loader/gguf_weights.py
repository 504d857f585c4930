"""GGUF files: the config, the tensor names and the tensor values all come the way
transformers' own GGUF loading makes them, so a GGUF loads here for every architecture
transformers can load from GGUF, and its tensors are bit-identical to transformers'.

- Config: transformers' GGUF metadata mapping (`load_gguf_checkpoint`).
- Names: transformers maps GGUF tensor names to Hugging Face ones from the state dict of
  the model it loads into (`get_gguf_hf_weights_map` over gguf-py's name table). We build
  that model class from the config on the meta device (no memory, no init) and ask the same.
- Values: each tensor is dequantized with the `gguf` package and passed through
  transformers' TensorProcessor of the architecture, e.g. llama.cpp's q/k row permutation of
  "llama" undone, Gemma's norm weights (stored by llama.cpp with the +1 of their (1 + w) scale
  folded in) taken back to Hugging Face's convention, MoE experts merged into one tensor.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)


def load_gguf_config(path: str) -> Any:
    """The transformers config of a GGUF file, as transformers itself builds it."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config_dict = dict(load_gguf_checkpoint(path, return_tensors=False)["config"])
    config_dict.pop("_model_name_or_path", None)
    return AutoConfig.for_model(**config_dict)


def tensor_processor(architecture: str, hf_config: Any) -> Any:
    """transformers' TensorProcessor of a GGUF architecture (the identity one if it has none)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())


def gguf_to_hf_names(hf_config: Any, processor: Any) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, exactly as transformers maps them when it loads
    the file into AutoModelForCausalLM (built here on the meta device, only for its names)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    return get_gguf_hf_weights_map(skeleton, processor)


def _float32_tensor(weights: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(weights, torch.Tensor):
        return weights.to(torch.float32)
    return torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))


class GGUFWeights:
    """Opens the file once; `len()` counts tensors, iteration yields (HF name, float32 tensor).
    GGUF tensors transformers has no name for (e.g. llama.cpp's precomputed rope_freqs) are
    skipped, as transformers skips them; a weight the model then lacks is reported by load_model."""

    def __init__(self, path: str, hf_config: Any):
        from gguf import GGUFReader

        self.reader = GGUFReader(path)
        self.config = hf_config
        field = self.reader.get_field("general.architecture")
        self.architecture = field.contents() if field is not None else None
        self.processor = tensor_processor(self.architecture, hf_config)
        self.names = gguf_to_hf_names(hf_config, self.processor)

    def __len__(self) -> int:
        return len(self.reader.tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        # Processors that assemble one Hugging Face tensor from several GGUF tensors (MoE
        # experts) keep it here, as transformers' loader does; they are yielded at the end.
        assembled: dict[str, dict] = {"tensors": {}}
        for tensor in self.reader.tensors:
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
