"""BERT-family encoders in plain torch, for embeddings: BERT, RoBERTa and XLM-RoBERTa (the
shapes of all-MiniLM, bge, e5, multilingual-e5, gte-base).

An encoder's tokens attend to the whole prompt both ways, so a prompt is computed in one step
(the engine schedules it so: `causal = False`, core/pooling/serving.py) and nothing is kept in
the KV cache: the flat batch's requests are told apart by their positions (each starts at 0),
gathered into a padded batch and attended with a padding mask, as transformers does. The
embeddings add absolute positions (RoBERTa's start after the padding index) and token type 0
(one sentence per input, as sentence-transformers encodes). Weights keep transformers' names,
with query/key/value fused into one projection (`qkv`).

The attention specs are declared as a decoder's would be, so the engine sizes and allocates a
KV cache as for any model; nothing writes or reads it (on the CPU its pages are never touched,
so it costs no memory)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..backend_contract import AttentionKernel, AttentionMetadata, AttentionSpec
from ..layers.linear import Embedding, Linear, MergedLinear
from ..layers.parallel import NO_TP, TensorParallel
from .base import CausalLM
from .weights import load_checkpoint_weights

STACKED_PARAMS = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
ROBERTA_TYPES = ("roberta", "xlm-roberta")  # positions start after the padding index
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
}
_IGNORED_PREFIXES = ("pooler.", "cls.", "lm_head.", "classifier.")


def position_offset(config: Any) -> int:
    """Where a prompt's positions start: 0 for BERT, after the padding index for RoBERTa."""
    return int(config.pad_token_id) + 1 if config.model_type in ROBERTA_TYPES else 0


@dataclass(frozen=True)
class PaddedBatch:
    """The step's prompts as a padded [batch, longest] layout: `index` holds each slot's flat
    token (0 for padding), `valid` which slots are tokens, `mask` the keys each may attend."""

    index: torch.Tensor  # [B * L] int64
    valid: torch.Tensor  # [B * L] bool
    mask: torch.Tensor  # [B, 1, 1, L] bool
    batch: int
    length: int

    @classmethod
    def of(cls, positions: torch.Tensor) -> PaddedBatch | None:
        """From the step's positions (each prompt starts at 0); None for a single prompt."""
        starts = torch.nonzero(positions == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            raise ValueError("an encoder step must hold whole prompts, each starting at position 0")
        if len(starts) == 1:
            return None
        ends = starts[1:] + [positions.shape[0]]
        lengths = torch.tensor([e - s for s, e in zip(starts, ends)])
        length = int(lengths.max())
        offsets = torch.arange(length)
        valid = offsets[None, :] < lengths[:, None]
        index = torch.where(valid, torch.tensor(starts)[:, None] + offsets[None, :], 0)
        device = positions.device
        return cls(index.flatten().to(device), valid.flatten().to(device), valid[:, None, None, :].to(device),
                   len(starts), length)


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                            padded: PaddedBatch | None) -> torch.Tensor:
    """q, k, v [T, heads * head_dim] of whole prompts -> [T, heads * head_dim], every token
    attending to every token of its own prompt."""
    tokens, width = q.shape
    head_dim = width // num_heads
    if padded is None:
        q, k, v = (x.view(1, tokens, num_heads, head_dim).transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(tokens, width)
    q, k, v = (x[padded.index].view(padded.batch, padded.length, num_heads, head_dim).transpose(1, 2)
               for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=padded.mask)
    return out.transpose(1, 2).reshape(padded.batch * padded.length, width)[padded.valid]


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size, dtype)
        self.token_type_embeddings = Embedding(config.type_vocab_size, config.hidden_size, dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)
        self.offset = position_offset(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.offset)
        return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        size = config.hidden_size
        self.qkv = MergedLinear(size, (size, size, size), bias=True, dtype=dtype)


class BertOutput(nn.Module):
    """A projection back to the hidden size, added to the residual and normalised."""

    def __init__(self, in_features: int, config: Any, dtype: torch.dtype):
        super().__init__()
        self.dense = Linear(in_features, config.hidden_size, bias=True, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.self = BertSelfAttention(config, dtype)
        self.output = BertOutput(config.hidden_size, config, dtype)
        self.num_heads, self.size = config.num_attention_heads, config.hidden_size

    def forward(self, hidden: torch.Tensor, padded: PaddedBatch | None) -> torch.Tensor:
        q, k, v = self.self.qkv(hidden).split(self.size, dim=-1)
        return self.output(bidirectional_attention(q, k, v, self.num_heads, padded), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, bias=True, dtype=dtype)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.attention = BertAttention(config, dtype)
        self.intermediate = BertIntermediate(config, dtype)
        self.output = BertOutput(config.intermediate_size, config, dtype)

    def forward(self, hidden: torch.Tensor, padded: PaddedBatch | None) -> torch.Tensor:
        attended = self.attention(hidden, padded)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))


class BertEmbeddingModel(CausalLM):
    """Build it under `with torch.device(device):`; weights come from `load_weights`. The
    encoder is not sharded (`tp` must be the whole model)."""

    causal = False

    def __init__(self, config: Any, make_kernel: Callable[[AttentionSpec], AttentionKernel], block_size: int,
                 dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        _check_supported(config, tp)
        self.config = config
        self.attention_specs = encoder_attention_specs(config, block_size, dtype)
        self.embeddings = BertEmbeddings(config, dtype)
        self.encoder = BertEncoder(config, dtype)

    @classmethod
    def context_limit(cls, hf_config: Any) -> int:
        return int(hf_config.max_position_embeddings) - position_offset(hf_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Whole prompts (positions from 0) -> the last layer's hidden states [T, hidden]."""
        padded = PaddedBatch.of(positions)
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, padded)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError("an encoder has no logits: its hidden states are pooled (core/pooling)")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        named = ((_encoder_name(name), tensor) for name, tensor in weights if _is_encoder_weight(name))
        return load_checkpoint_weights(self, named, STACKED_PARAMS, tied_lm_head=False)


def encoder_attention_specs(config: Any, block_size: int, dtype: torch.dtype) -> list[AttentionSpec]:
    """An encoder's specs, one per layer, declared only for the engine's accounting: its attention
    runs over the padded step (PaddedBatch), never through the KV cache."""
    head_dim = config.hidden_size // config.num_attention_heads
    return [AttentionSpec(num_heads=config.num_attention_heads, num_kv_heads=config.num_attention_heads,
                          head_dim=head_dim, block_size=block_size, scale=head_dim ** -0.5, dtype=dtype)
            for _ in range(config.num_hidden_layers)]


def _check_supported(config: Any, tp: TensorParallel) -> None:
    if tp.world_size > 1:
        raise NotImplementedError("an encoder is not sharded")
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise NotImplementedError(f"position_embedding_type {kind!r} (only 'absolute')")
    if config.hidden_act not in _ACTIVATIONS:
        raise NotImplementedError(f"hidden_act {config.hidden_act!r} (only {', '.join(_ACTIVATIONS)})")
    if getattr(config, "is_decoder", False):
        raise NotImplementedError("a BERT configured as a decoder")


def _strip(name: str) -> str:
    for prefix in ("bert.", "roberta.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _is_encoder_weight(name: str) -> bool:
    name = _strip(name)
    return not name.startswith(_IGNORED_PREFIXES) and not name.endswith("position_ids")


def _encoder_name(name: str) -> str:
    """Our name of a checkpoint tensor: no task prefix, LayerNorm's old gamma / beta as weight / bias."""
    name = _strip(name)
    if name.endswith(".gamma"):
        return name[:-len("gamma")] + "weight"
    if name.endswith(".beta"):
        return name[:-len("beta")] + "bias"
    return name
