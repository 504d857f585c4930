"""`VisionLanguageModel`: what every vision-language model class shares (idefics3.py, qwen2_vl.py,
gemma3_vision.py). Its text model (`language`, a CausalLM) runs as it would alone; the runner
(core/multimodal/splice.py) takes `embed_tokens` of a step's tokens, writes each image's
`encode_images` rows over its image tokens and passes the result as `inputs_embeds`. The methods
the engine asks of a text model go to `language`; a checkpoint's weights are split by `route`
between the text model's own loader and the vision modules, copied whole."""
from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..layers.linear import read_whole
from ..layers.parallel import TensorParallel
from .base import CausalLM

TEXT, TOWER = "text", "tower"


def text_config_of(config: Any, tied_by_default: bool = False) -> Any:
    """The text model's config (a copy of config.text_config), with the checkpoint's top-level choice
    of tied embeddings (`tied_by_default` where it makes none: the family's default)."""
    text = copy.copy(config.text_config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tied_by_default))
    return text


def empty_module(make: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    """A module built without random init (every weight comes from the checkpoint), on the
    current default device, in `dtype`."""
    device = torch.get_default_device()
    with torch.device("meta"):
        module = make()
    return module.to_empty(device=device).to(dtype)


class VisionLanguageModel(CausalLM):
    """Images in, text out: `language` is the text model; `image_token_id` marks the positions that
    take image rows (the family's expansion, core/multimodal/). Subclasses build `language` and
    their vision modules, and say where each checkpoint name goes (`route`)."""

    def __init__(self, config: Any, language: CausalLM, tp: TensorParallel):
        super().__init__()
        if tp.world_size > 1:
            raise NotImplementedError("tensor parallelism is not implemented for vision-language models")
        self.config = config
        self.image_token_id = int(config.image_token_id)
        self.language = language
        self.attention_specs = language.attention_specs

    @classmethod
    def context_limit(cls, hf_config: Any) -> int | None:
        return getattr(hf_config.text_config, "max_position_embeddings", None)

    def fit_context(self, max_model_len: int) -> None:
        self.language.fit_context(max_model_len)

    def output_head(self) -> nn.Module:
        return self.language.output_head()

    def decoder_layout(self):
        """The text model's: a backend may run its decoder its own way (the CPU's fused C++ layers)
        on steps without image tokens; a step with image tokens always runs the model's forward
        (ModelRunner.forward_images), since only it takes input embeddings."""
        return self.language.decoder_layout()

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text model's input embeddings of `input_ids` [T] -> [T, hidden]."""
        return self.language.model.embed_tokens(input_ids)

    @abstractmethod
    def encode_images(self, frames: Any) -> torch.Tensor:
        """One image's frames (its family's, core/multimodal/) -> its rows [image tokens, text
        hidden], in the order of its image tokens."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language.compute_logits(hidden)

    @staticmethod
    @abstractmethod
    def route(name: str) -> tuple[str, str]:
        """A checkpoint name -> (TEXT, the name the text model's loader takes) or (TOWER, the name
        of our parameter it fills)."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """The text model's weights go to its own loader under its names; the vision modules' are
        copied whole, each checked against its parameter's shape."""
        ours = dict(self.named_parameters())
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                part, target = self.route(name)
                if part == TEXT:
                    yield target, tensor
                    continue
                if target not in ours:
                    raise ValueError(f"unknown vision weight {name}")
                tensor = read_whole(tensor)
                if ours[target].shape != tensor.shape:
                    raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(ours[target].shape)}")
                ours[target].data.copy_(tensor)
                loaded.add(target)

        loaded |= {"language." + name for name in self.language.load_weights(text_weights())}
        return loaded
