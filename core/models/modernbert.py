"""ModernBERT in plain torch, for embeddings (transformers' `ModernBertModel`: ModernBERT-base /
-large, gte-modernbert, modernbert-embed, nomic's and Alibaba's ModernBERT embedders).

It is served as bert.py's encoders are (read its docstring first): a prompt is computed whole in
one step (`causal = False`), the step's prompts are told apart by their positions (each starts at
0) and attended as a padded batch (bert.py's `PaddedBatch`), and nothing is written to or read
from the KV cache, whose specs are declared only for the engine's accounting.

What differs from BERT, as transformers' modeling_modernbert.py computes it:

- embeddings: the token embedding and a LayerNorm, no positions (rotary instead) and no token type;
- pre-norm layers (the first layer's `attn_norm` is the identity, the embeddings' norm stands in),
  one fused `Wqkv`, and a `final_norm` after the last layer;
- rotary positions ("rotate half"), with `rope_parameters["full_attention"]` (`global_rope_theta`,
  160k) on the global layers and `["sliding_attention"]` (`local_rope_theta`, 10k) on the local ones;
- local layers attend only to keys within `local_attention // 2` positions either side (a window of
  `local_attention` tokens); every `global_attn_every_n_layers`-th layer (0, 3, 6, ...) is global
  (`config.layer_types`, which transformers 5 derives from it);
- a gated MLP: `Wi` -> [input, gate] -> act(input) * gate -> `Wo` (GeGLU with the default gelu);
- LayerNorm, attention and MLP biases as `norm_bias`, `attention_bias` and `mlp_bias` say.

Weights keep the checkpoint's names; a masked-LM or classifier checkpoint's `model.` prefix is
dropped and its head (`head.`, `decoder.`, `classifier.`) ignored."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..backend_contract import AttentionKernel, AttentionMetadata, AttentionSpec
from ..layers.linear import Embedding, Linear
from ..layers.parallel import NO_TP, TensorParallel
from ..layers.rotary import RotaryEmbedding, apply_rotary
from .base import CausalLM
from .bert import PaddedBatch, encoder_attention_specs
from .weights import load_checkpoint_weights

GLOBAL, LOCAL = "full_attention", "sliding_attention"  # transformers' layer_types
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
}
_IGNORED_PREFIXES = ("head.", "decoder.", "classifier.", "drop.")
_DEFAULT_THETA = {GLOBAL: 160_000.0, LOCAL: 10_000.0}  # ModernBertConfig's defaults


def layer_types(config: Any) -> list[str]:
    """Each layer's attention: `config.layer_types` (transformers 5), else every
    `global_attn_every_n_layers`-th layer global from layer 0, the rest local."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    every = int(getattr(config, "global_attn_every_n_layers", 3))
    return [LOCAL if i % every else GLOBAL for i in range(config.num_hidden_layers)]


def rope_settings(config: Any, layer_type: str) -> tuple[float, dict]:
    """(theta, scaling dict) of one layer type: `rope_parameters[layer_type]` (transformers 5),
    else the older `global_rope_theta` / `local_rope_theta`."""
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
    if params:
        scaling = dict(params)
        return float(scaling.pop("rope_theta", _DEFAULT_THETA[layer_type])), scaling
    old_name = "global_rope_theta" if layer_type == GLOBAL else "local_rope_theta"
    theta = getattr(config, old_name, None)
    return float(theta if theta is not None else _DEFAULT_THETA[layer_type]), {"rope_type": "default"}


class AttentionMasks:
    """The step's masks, built once per step and shared by every layer of a type, bool over the
    padded layout (bert.py's PaddedBatch; L: the longest prompt), True where a query attends a
    key: its own prompt's tokens ([B, 1, 1, L]), on a local layer only those within
    `half_window` positions ([B, 1, L, L]); None where nothing is masked (one prompt, on a local
    layer one the window does not cut). A padding slot may attend itself, so its row is never
    empty (its output is dropped)."""

    def __init__(self, positions: torch.Tensor, padded: PaddedBatch | None, half_window: int):
        length = positions.shape[0] if padded is None else padded.length
        offsets = torch.arange(length, device=positions.device)
        keys = None if padded is None else padded.mask  # [B, 1, 1, L]: which slots are tokens
        self.full = keys
        if length > half_window + 1:
            near = (offsets[:, None] - offsets[None, :]).abs() <= half_window  # [L, L]
            self.local = near[None, None] if keys is None else (near & keys) | torch.eye(
                length, dtype=torch.bool, device=positions.device)
        else:
            self.local = keys

    def of(self, layer_type: str) -> torch.Tensor | None:
        return self.local if layer_type == LOCAL else self.full


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int,
                      padded: PaddedBatch | None, mask: torch.Tensor | None) -> torch.Tensor:
    """q, k, v [T, heads * head_dim] of whole prompts -> [T, heads * head_dim], each token
    attending to the keys of its own prompt that `mask` allows (AttentionMasks)."""
    tokens, width = q.shape
    heads = width // head_dim
    if padded is None:
        q, k, v = (x.view(1, tokens, heads, head_dim).transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(tokens, width)
    q, k, v = (x[padded.index].view(padded.batch, padded.length, heads, head_dim).transpose(1, 2)
               for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(padded.batch * padded.length, width)[padded.valid]


def layer_norm(config: Any, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias, dtype=dtype)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.tok_embeddings = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.norm = layer_norm(config, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    """Fused Wqkv, rotary queries and keys, attention within the layer type's mask, Wo."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        size = config.hidden_size
        self.head_dim = size // config.num_attention_heads
        self.Wqkv = Linear(size, 3 * size, bias=config.attention_bias, dtype=dtype)
        self.Wo = Linear(size, size, bias=config.attention_bias, dtype=dtype)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], padded: PaddedBatch | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.Wqkv(hidden).view(tokens, 3, -1, self.head_dim).unbind(1)  # [T, heads, head_dim]
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        q, k, v = (x.reshape(tokens, -1) for x in (q, k, v))
        return self.Wo(encoder_attention(q, k, v, self.head_dim, padded, mask))


class ModernBertMLP(nn.Module):
    """Wi -> [input, gate] -> act(input) * gate -> Wo."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.Wi = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias, dtype=dtype)
        self.Wo = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias, dtype=dtype)
        self.act = _ACTIVATIONS[config.hidden_activation]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        up, gate = self.Wi(hidden).chunk(2, dim=-1)
        return self.Wo(self.act(up) * gate)


class ModernBertLayer(nn.Module):
    """Pre-norm: hidden + attn(attn_norm(hidden)), then + mlp(mlp_norm(.))."""

    def __init__(self, config: Any, index: int, dtype: torch.dtype):
        super().__init__()
        self.attention_type = layer_types(config)[index]
        self.attn_norm = nn.Identity() if index == 0 else layer_norm(config, dtype)
        self.attn = ModernBertAttention(config, dtype)
        self.mlp_norm = layer_norm(config, dtype)
        self.mlp = ModernBertMLP(config, dtype)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], padded: PaddedBatch | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), rotary, padded, mask)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertEmbeddingModel(CausalLM):
    """Build it under `with torch.device(device):`; weights come from `load_weights`. The
    encoder is not sharded (`tp` must be the whole model)."""

    causal = False

    def __init__(self, config: Any, make_kernel: Callable[[AttentionSpec], AttentionKernel], block_size: int,
                 dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        _check_supported(config, tp)
        self.config = config
        head_dim = config.hidden_size // config.num_attention_heads
        self.attention_specs = encoder_attention_specs(config, block_size, dtype)
        self.half_window = int(config.local_attention) // 2
        self.embeddings = ModernBertEmbeddings(config, dtype)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.final_norm = layer_norm(config, dtype)
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(head_dim, *rope_settings(config, kind))
                                     for kind in sorted(set(layer_types(config)))})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Whole prompts (positions from 0) -> the final norm's hidden states [T, hidden]."""
        padded = PaddedBatch.of(positions)
        masks = AttentionMasks(positions, padded, self.half_window)
        hidden = self.embeddings(input_ids)
        rotary = {kind: table(positions, hidden.dtype) for kind, table in self.rotary.items()}
        for layer in self.layers:
            hidden = layer(hidden, rotary[layer.attention_type], padded, masks.of(layer.attention_type))
        return self.final_norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError("an encoder has no logits: its hidden states are pooled (core/pooling)")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        named = ((_strip(name), tensor) for name, tensor in weights if not _strip(name).startswith(_IGNORED_PREFIXES))
        return load_checkpoint_weights(self, named, {}, tied_lm_head=False)


def _check_supported(config: Any, tp: TensorParallel) -> None:
    if tp.world_size > 1:
        raise NotImplementedError("an encoder is not sharded")
    if config.hidden_activation not in _ACTIVATIONS:
        raise NotImplementedError(f"hidden_activation {config.hidden_activation!r} "
                                  f"(only {', '.join(_ACTIVATIONS)})")
    unknown = set(layer_types(config)) - {GLOBAL, LOCAL}
    if unknown:
        raise NotImplementedError(f"layer types {sorted(unknown)} (only {GLOBAL}, {LOCAL})")


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name
