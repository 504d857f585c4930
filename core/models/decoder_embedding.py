"""A Llama-family decoder served for embeddings (Qwen3-Embedding, gte-Qwen2, e5-mistral shapes):
the decoder without its output head, whose last hidden states the engine pools (core/pooling).

Embedding checkpoints leave the head out, and those saved as the bare decoder by
sentence-transformers (transformers' Qwen3Model, LlamaModel: `layers.0...` without `model.`)
load as well as a causal LM's (`model.layers.0...`); a head the checkpoint has is skipped."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .llama import STACKED_PARAMS, LlamaForCausalLM
from .weights import load_checkpoint_weights


class LlamaEmbeddingModel(LlamaForCausalLM):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lm_head = None  # never built into the weights: the hidden states are the output

    def output_head(self) -> None:
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError("an embedding model has no output head: its hidden states are pooled (core/pooling)")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        named = ((_decoder_name(name), tensor) for name, tensor in weights if not _is_head(name))
        return load_checkpoint_weights(self, named, STACKED_PARAMS, tied_lm_head=False)


def _is_head(name: str) -> bool:
    return name.startswith(("lm_head.", "score."))


def _decoder_name(name: str) -> str:
    """A bare decoder's name (`layers.0.mlp...`, `embed_tokens.weight`, `norm.weight`) as the
    causal LM's (`model.` + it)."""
    return name if name.startswith("model.") else f"model.{name}"
