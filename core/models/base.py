"""`CausalLM`: what every model class declares to the loader, the runner and the backends.

Native models (llama.py, gemma.py and their subclasses) and the transformers fallback
(transformers_fallback.py) subclass it. Built under `with torch.device(device):` from
(hf_config, make_kernel, block_size, dtype, tp), weights loaded afterwards by load_weights.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..backend_contract import AttentionMetadata, AttentionSpec
from .layout import DecoderLayout


class CausalLM(nn.Module, ABC):
    """A causal language model over the paged KV cache. Subclasses set `attention_specs`
    (one AttentionSpec per layer) in __init__."""

    attention_specs: list[AttentionSpec] | tuple[AttentionSpec, ...]
    # False: an encoder (core/models/bert.py): every token attends to the whole prompt, so a
    # prompt is computed in one step and no key or value is kept (the engine schedules it so,
    # core/pooling/serving.py); it pools (embeddings) and has no logits.
    causal: bool = True
    # A vision-language model's image family (a key of core/multimodal/families.py's FAMILIES): it
    # then also has `image_token_id`, `embed_tokens(input_ids)` and `encode_images(frames)`, and
    # the runner writes image rows over the image tokens' input embeddings (core/multimodal/splice.py).
    # None: a text model.
    image_family: str | None = None
    # True: a step with image tokens gives forward positions [3, T] (M-RoPE's t, h, w: the image
    # tokens' from their image's grid, core/multimodal/positions.py); every other step, 1D
    # positions already shifted by the images before them. False: positions [T] always.
    grid_positions: bool = False
    # True: the image tokens of one image (its Expansion's embed_offsets, one run) attend to each
    # other both ways (Gemma 3); everything else is causal. The scheduler never ends a prompt chunk
    # inside such a run, and the runner lays a chunk with image tokens out as decode rows, each image
    # token's row attending up to its image's last token (core/multimodal/image_rows.py).
    bidirectional_images: bool = False

    @classmethod
    def context_limit(cls, hf_config: Any) -> int | None:
        """The longest prompt the model's positions allow (the loader's max_model_len bound); by
        default the config's max_position_embeddings."""
        return getattr(hf_config, "max_position_embeddings", None)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (the model dtype)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (select the rows you need first)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy (checkpoint name, tensor) pairs into the parameters; returns the names loaded."""

    def decoder_layout(self) -> DecoderLayout | None:
        """This model's decoder as core/models/layout.py declares it, for backends that run
        those layers their own way; None (the default): run the layers as written."""
        return None

    def vision_modules(self) -> tuple[nn.Module, ...]:
        """A vision-language model's vision tower and connector, which the loader puts in
        ModelConfig.vision_dtype (their encode_images reads their dtype); () for a text model."""
        return ()

    def output_head(self) -> nn.Module | None:
        """The output projection as one of core's Linear layers, which --quantize treats as the
        head (core/quant/apply.py); None (the default) when the model has no such layer."""
        return None

    def fit_context(self, max_model_len: int) -> None:
        """Called by the loader with the served context length (e.g. longrope picks its
        factors for it). The default needs nothing."""
