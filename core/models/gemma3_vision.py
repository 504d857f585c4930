"""Gemma 3's vision-language model (Gemma 3 4B and up): a SigLIP vision tower (siglip.py's, with
SigLIP's own position embeddings), Gemma 3's projector, and the Gemma 3 text model gemma.py serves,
in one engine.

An image is one frame of the tower's size (896x896 in Gemma 3: 64x64 patches of 14); the projector
average-pools the patch grid to mm_tokens_per_image tokens (256: 4x4 pools), normalises them with
Gemma's RMSNorm (1 + weight) and multiplies by mm_input_projection_weight. Those rows replace the
input embeddings of the image's <image_soft_token>s as they are: transformers writes them over the
text model's scaled embeddings, unscaled, which is what the runner's splice does with
`embed_tokens` (scaled) and `forward(inputs_embeds=...)` (used as given).

Gemma 3 attends the soft tokens of one image to each other both ways (transformers' token_type_ids
mask); everything else is causal. The model declares it (`bidirectional_images`): the scheduler then
never ends a prompt chunk inside an image's soft tokens, and the runner lays a chunk with image
tokens out as decode rows, an image token's row attending up to its image's last soft token
(core/execution/runner.py, core/multimodal/image_rows.py), within the backends' causal contract.

Checkpoint names: transformers 5's (`model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, `lm_head.*`) and those it saves and the Hub's hold
(`language_model.model.*`, `vision_tower[.vision_model].*`, `multi_modal_projector.*`); with a
GGUF pair, the text GGUF's (the text model's own, `model.*`) and the mmproj file's (Hub names).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..backend_contract import AttentionMetadata
from ..layers.offset_norm import OffsetRMSNorm
from ..layers.parallel import NO_TP, TensorParallel
from .gemma import GemmaForCausalLM
from .llama import KernelFactory
from .siglip import FullGridVisionTransformer
from .vlm import TEXT, TOWER, VisionLanguageModel, empty_module, text_config_of


class Gemma3Projector(nn.Module):
    """transformers' Gemma3MultiModalProjector: patch states [F, side * side, d] -> [F, tokens, text
    hidden], average-pooled over (side / sqrt(tokens))^2 patches, RMSNorm (1 + weight), projected."""

    def __init__(self, config: Any):
        super().__init__()
        vision = config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} does not pool a "
                             f"{self.patches_per_side}x{self.patches_per_side} patch grid")
        self.kernel_size = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, config.text_config.hidden_size),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = OffsetRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        frames, _, hidden = patches.shape
        side = self.patches_per_side
        grid = patches.transpose(1, 2).reshape(frames, hidden, side, side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel_size, self.kernel_size).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """Gemma 3 with images in, text out. `image_token_id` marks the positions that take image
    embeddings (<image_soft_token>, the family's expansion: core/multimodal/gemma3.py)."""

    image_family = "gemma3"
    bidirectional_images = True

    def __init__(self, config: Any, make_kernel: KernelFactory, block_size: int, dtype: torch.dtype,
                 tp: TensorParallel = NO_TP):
        super().__init__(config, GemmaForCausalLM(text_config_of(config, tied_by_default=True), make_kernel,
                                                  block_size, dtype, tp), tp)
        # transformers looks an image token up as token 0 where it lies past the vocabulary
        self._image_token_outside_vocab = self.image_token_id >= config.text_config.vocab_size
        self.vision_tower = empty_module(lambda: FullGridVisionTransformer(config.vision_config), dtype)
        self.multi_modal_projector = empty_module(lambda: Gemma3Projector(config), dtype)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text model's input embeddings of `input_ids` [T] -> [T, hidden] (scaled by
        sqrt(hidden), as Gemma's are)."""
        if self._image_token_outside_vocab:
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        return self.language.model.embed_tokens(input_ids)

    def vision_modules(self) -> tuple[nn.Module, ...]:
        return self.vision_tower, self.multi_modal_projector

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's frames [F, 3, S, S] -> its embeddings [F * mm_tokens_per_image, text hidden],
        in the order of its soft tokens."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        features = self.multi_modal_projector(self.vision_tower(pixels.to(dtype)))
        return features.reshape(-1, features.shape[-1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        model = self.language.model
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        tables = {key: rotary(positions, hidden.dtype) for key, rotary in model.rotary_emb.items()}
        for layer, key, kv_cache in zip(model.layers, model.layer_rope_keys, kv_caches, strict=True):
            hidden = layer(hidden, *tables[key], kv_cache, meta)
        return model.norm(hidden)

    @staticmethod
    def route(name: str) -> tuple[str, str]:
        """transformers 5's names and the Hub's (see the module's docstring); the text model's own
        names (`model.*`, `lm_head.*`: a GGUF pair's language model, core/loader/mmproj.py) as they are."""
        part = name.removeprefix("model.")
        if part.startswith("language_model."):
            rest = part[len("language_model."):]
            return TEXT, rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
        if part.startswith("vision_tower."):
            return TOWER, "vision_tower." + part[len("vision_tower."):].removeprefix("vision_model.")
        if part.startswith("multi_modal_projector."):
            return TOWER, part
        return TEXT, name
