"""Idefics3 and SmolVLM: a SigLIP vision tower and pixel-shuffle connector (siglip.py) before the
Llama text model llama.py serves, in one engine.

The text model runs exactly as LlamaForCausalLM (the paged KV cache, the ragged batch); the only
difference is its input: the runner (core/execution/runner.py, core/multimodal/splice.py) takes
`embed_tokens` of the step's tokens, writes each image's `encode_images` rows over its image
tokens, and passes the result as `inputs_embeds`. Checkpoint names are transformers' (`model.
vision_model.*`, `model.connector.*`, `model.text_model.*`, `lm_head.*`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..backend_contract import AttentionMetadata
from ..layers.parallel import NO_TP, TensorParallel
from .llama import KernelFactory, LlamaForCausalLM
from .siglip import PixelShuffleConnector, VisionTransformer
from .vlm import TEXT, TOWER, VisionLanguageModel, empty_module, text_config_of

_TEXT_PREFIX, _VISION_PREFIXES = "model.text_model.", ("model.vision_model.", "model.connector.")


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    """A vision-language model: images in, text out. `image_token_id` marks the positions that
    take image embeddings (the processor's expansion, core/multimodal/idefics3.py)."""

    image_family = "idefics3"

    def __init__(self, config: Any, make_kernel: KernelFactory, block_size: int, dtype: torch.dtype,
                 tp: TensorParallel = NO_TP):
        super().__init__(config, LlamaForCausalLM(text_config_of(config), make_kernel, block_size, dtype, tp), tp)
        vision = config.vision_config
        self.vision_model = empty_module(lambda: VisionTransformer(vision), dtype)
        self.connector = empty_module(lambda: PixelShuffleConnector(
            vision.hidden_size, config.text_config.hidden_size, int(config.scale_factor)), dtype)

    def vision_modules(self) -> tuple[nn.Module, ...]:
        return self.vision_model, self.connector

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

    @staticmethod
    def route(name: str) -> tuple[str, str]:
        """The text model's weights under LlamaForCausalLM's names; the tower's and connector's as ours."""
        if name.startswith(_VISION_PREFIXES):
            return TOWER, name[len("model."):]
        if name.startswith(_TEXT_PREFIX):
            return TEXT, "model." + name[len(_TEXT_PREFIX):]
        return TEXT, name
