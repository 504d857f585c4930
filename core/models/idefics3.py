"""Idefics3 and SmolVLM: a SigLIP vision tower and pixel-shuffle connector (siglip.py) before the
Llama text model llama.py serves, in one engine.

The text model runs exactly as LlamaForCausalLM (the paged KV cache, the ragged batch); the only
difference is its input: the runner (core/execution/runner.py, core/multimodal/splice.py) takes
`embed_tokens` of the step's tokens, writes each image's `encode_images` rows over its image
tokens, and passes the result as `inputs_embeds`. Checkpoint names are transformers' (`model.
vision_model.*`, `model.connector.*`, `model.text_model.*`, `lm_head.*`).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..backend_contract import AttentionMetadata
from ..layers.linear import read_whole
from ..layers.parallel import NO_TP, TensorParallel
from .base import CausalLM
from .llama import KernelFactory, LlamaForCausalLM
from .siglip import PixelShuffleConnector, VisionTransformer

_TEXT_PREFIX, _VISION_PREFIXES = "model.text_model.", ("model.vision_model.", "model.connector.")


def text_config_of(config: Any) -> Any:
    """The text model's config, with the top-level choice of tied embeddings (the checkpoint's)."""
    text = copy.copy(config.text_config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


class Idefics3ForConditionalGeneration(CausalLM):
    """A vision-language model: images in, text out. `image_token_id` marks the positions that
    take image embeddings (the processor's expansion, core/multimodal/families.py)."""

    image_family = "idefics3"

    def __init__(self, config: Any, make_kernel: KernelFactory, block_size: int, dtype: torch.dtype,
                 tp: TensorParallel = NO_TP):
        super().__init__()
        if tp.world_size > 1:
            raise NotImplementedError("tensor parallelism is not implemented for vision-language models")
        self.config = config
        self.image_token_id = int(config.image_token_id)
        self.language = LlamaForCausalLM(text_config_of(config), make_kernel, block_size, dtype, tp)
        self.attention_specs = self.language.attention_specs
        vision = config.vision_config
        device = torch.get_default_device()
        with torch.device("meta"):  # no random init: every weight comes from the checkpoint
            self.vision_model = VisionTransformer(vision)
            self.connector = PixelShuffleConnector(vision.hidden_size, config.text_config.hidden_size,
                                                   int(config.scale_factor))
        self.vision_model.to_empty(device=device).to(dtype)
        self.connector.to_empty(device=device).to(dtype)

    @classmethod
    def context_limit(cls, hf_config: Any) -> int | None:
        return getattr(hf_config.text_config, "max_position_embeddings", None)

    def fit_context(self, max_model_len: int) -> None:
        self.language.fit_context(max_model_len)

    def output_head(self) -> nn.Module:
        return self.language.output_head()

    def decoder_layout(self):
        """The text model's: a backend may run its decoder its own way (the CPU's fused C++ layers)
        on steps without images; a step with image tokens always runs this forward
        (ModelRunner.forward_images), since only it takes input embeddings."""
        return self.language.decoder_layout()

    def vision_modules(self) -> tuple[nn.Module, ...]:
        return self.vision_model, self.connector

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text model's input embeddings of `input_ids` [T] -> [T, hidden]."""
        return self.language.model.embed_tokens(input_ids)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's frames [F, 3, S, S] -> its embeddings [F * tokens per frame, text hidden], in
        the order of its image tokens."""
        dtype = self.connector.modality_projection.proj.weight.dtype
        features = self.connector(self.vision_model(pixels.to(dtype)))
        return features.reshape(-1, features.shape[-1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        model = self.language.model
        hidden = model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = model.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """The text model's weights go to LlamaForCausalLM's loader under its names; the vision
        tower's and the connector's are copied whole."""
        towers = dict(self.named_parameters())
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                if name.startswith(_VISION_PREFIXES):
                    ours = name[len("model."):]
                    if ours not in towers:
                        raise ValueError(f"unknown vision weight {name}")
                    tensor = read_whole(tensor)
                    if towers[ours].shape != tensor.shape:
                        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(towers[ours].shape)}")
                    towers[ours].data.copy_(tensor)
                    loaded.add(ours)
                elif name.startswith(_TEXT_PREFIX):
                    yield "model." + name[len(_TEXT_PREFIX):], tensor
                else:
                    yield name, tensor

        loaded |= {"language." + name for name in self.language.load_weights(text_weights())}
        return loaded
