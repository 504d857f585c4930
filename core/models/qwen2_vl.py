"""Qwen2-VL and Qwen2.5-VL: the vision tower (qwen2_vision.py, qwen2_5_vision.py) before the
Qwen2 text model llama.py serves, with M-RoPE, in one engine.

The text model runs exactly as LlamaForCausalLM (q/k/v bias, the paged KV cache, the ragged
batch); the differences are its input (the runner writes each image's `encode_images` rows over
its `<|image_pad|>` tokens, core/multimodal/splice.py) and its positions: M-RoPE's (t, h, w) ids
(core/multimodal/positions.py). A step with image tokens gives positions [3, T], turned by
`mrope_section` (each band of a head's frequencies takes its t, h or w id); every other step
gives 1D positions (equal ids: plain RoPE), shifted past the images before them, so text steps
(decodes, the CPU's fused decode layers) run as any Qwen2's. Checkpoint names: transformers'
(`model.visual.*`, `model.language_model.*`, `lm_head.*`), or the original checkpoints' (`visual.*`,
`model.*`, `lm_head.*`), which transformers 5 also saves.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..backend_contract import AttentionMetadata
from ..layers.parallel import NO_TP, TensorParallel
from ..layers.rotary import rope_parameters
from .llama import KernelFactory, LlamaForCausalLM
from .qwen2_5_vision import Qwen25VisionTransformer
from .qwen2_vision import Qwen2VisionTransformer
from .vlm import TEXT, TOWER, VisionLanguageModel, empty_module
from .vlm import text_config_of as vl_text_config

_VISION_PREFIXES = ("model.visual.", "visual.")
_TEXT_PREFIX = "model.language_model."


def text_config_of(config: Any) -> Any:
    """The Qwen2 text model's config: Qwen2's q/k/v bias, head_dim hidden / heads (as transformers'
    Qwen2VLAttention), plain rotary frequencies (mrope_section is applied here), and the top-level
    choice of tied embeddings."""
    text = vl_text_config(config)
    text.model_type = "qwen2"
    text.head_dim = text.hidden_size // text.num_attention_heads
    return text


def mrope_section_of(config: Any) -> list[int]:
    """The frequency bands of t, h and w (rope_parameters, or a 4.x config's rope_scaling)."""
    _, scaling = rope_parameters(config)
    section = scaling.get("mrope_section")
    if section is None:
        raise ValueError("a Qwen2-VL text config without rope_parameters' mrope_section")
    return list(section)


class MropeTables:
    """M-RoPE's cos and sign-folded sin tables (core/layers/rotary.py's layout, [T, 1, head_dim])
    from positions [3, T]: the i-th band of `mrope_section` turns with the (i % 3)-th id (t, h, w),
    as transformers' Qwen2VLRotaryEmbedding; the text model's own frequencies."""

    def __init__(self, rotary: nn.Module, mrope_section: list[int]):
        self.rotary, self.section = rotary, mrope_section
        if sum(mrope_section) != rotary.inv_freq.shape[0]:
            raise ValueError(f"mrope_section {mrope_section} does not sum to head_dim / 2 = "
                             f"{rotary.inv_freq.shape[0]}")

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.rotary.inv_freq  # [3, T, D/2]
        freqs = torch.cat([band[i % 3] for i, band in enumerate(freqs.split(self.section, dim=-1))], dim=-1)
        cos, sin = freqs.cos(), freqs.sin()
        if self.rotary.attention_scaling != 1.0:
            cos, sin = cos * self.rotary.attention_scaling, sin * self.rotary.attention_scaling
        return (torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1),
                torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1))


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """A vision-language model: images in, text out. `image_token_id` (<|image_pad|>) marks the
    positions that take image embeddings (core/multimodal/qwen2_vl.py); its positions follow each
    image's grid (`grid_positions`)."""

    image_family = "qwen2_vl"
    grid_positions = True
    vision_class: type[nn.Module] = Qwen2VisionTransformer

    def __init__(self, config: Any, make_kernel: KernelFactory, block_size: int, dtype: torch.dtype,
                 tp: TensorParallel = NO_TP):
        super().__init__(config, LlamaForCausalLM(text_config_of(config), make_kernel, block_size, dtype, tp), tp)
        self.mrope = MropeTables(self.language.model.rotary_emb, mrope_section_of(config.text_config))
        self.visual = empty_module(lambda: self.vision_class(config.vision_config), dtype)

    def vision_modules(self) -> tuple[nn.Module, ...]:
        return (self.visual,)

    def encode_images(self, frames: Any) -> torch.Tensor:
        """One image's frames (core/multimodal/qwen2_vl.py GridPatches: patches [t*h*w, C*T*P*P],
        grid (t, h, w) in patches) -> its embeddings [t*h*w / merge**2, text hidden], in the order
        of its image tokens."""
        return self.visual(frames.patches, frames.grid)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """positions [T] (1D, shifted past earlier images) or [3, T] (M-RoPE: a step with image tokens)."""
        model = self.language.model
        hidden = model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        tables = self.mrope if positions.dim() == 2 else model.rotary_emb
        cos, sin = tables(positions, hidden.dtype)
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return model.norm(hidden)

    @staticmethod
    def route(name: str) -> tuple[str, str]:
        """transformers 5's names or the original checkpoints' (see the module's docstring)."""
        prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            return TOWER, "visual." + name[len(prefix):]
        if name.startswith(_TEXT_PREFIX):
            return TEXT, "model." + name[len(_TEXT_PREFIX):]
        return TEXT, name


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL's text model, M-RoPE positions and image family (the same processor);
    its own vision tower (qwen2_5_vision.py: RMSNorm, SwiGLU, window attention)."""

    vision_class = Qwen25VisionTransformer
