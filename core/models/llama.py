"""Llama-family decoder in plain torch: Llama, Mistral, Qwen2 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm), SmolLM.

The flat batch holds every scheduled token of every request, no padding:
input_ids and positions are [T]; the attention call site (PagedAttention) reads the
per-request layout from AttentionMetadata. Weights use Hugging Face names, with
q/k/v and gate/up fused into one projection each (`load_weights` fills the slices).

Tensor parallelism (`tp`, core/layers/parallel.py): each shard builds its own heads and
MLP slice; attention and MLP return partial sums that the decoder layer reduces.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..backend_contract import AttentionKernel, AttentionMetadata, AttentionSpec
from ..layers import PagedAttention, RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary, rope_parameters
from ..layers.parallel import (NO_TP, TensorParallel, merged_column_parallel, parallel_embedding,
                               parallel_lm_head, row_parallel)
from ..layers.rotary import apply_partial_rotary, rotary_dim
from .base import CausalLM
from .layout import DecoderLayout, LayerParts
from .sharding import AttentionShard
from .weights import load_checkpoint_weights

KernelFactory = Callable[[AttentionSpec], AttentionKernel]

# Hugging Face projection name -> (our fused projection, shard index).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")  # per-head RMSNorm of q and k before rotary


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """Window of this layer (transformers' layer_types when present, else Qwen2's
    use_sliding_window/max_window_layers rule, else the config's sliding_window)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if layer_idx >= getattr(config, "max_window_layers", 0) else None


def attention_shard(config: Any, tp: TensorParallel) -> AttentionShard:
    return AttentionShard.of(config.num_attention_heads, config.num_key_value_heads, head_dim_of(config), tp)


def attention_specs(config: Any, block_size: int, dtype: torch.dtype, tp: TensorParallel = NO_TP
                    ) -> list[AttentionSpec]:
    """One AttentionSpec per layer (they differ only in sliding_window), with this shard's heads."""
    head_dim, shard = head_dim_of(config), attention_shard(config, tp)
    return [AttentionSpec(num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                          head_dim=head_dim, block_size=block_size, scale=head_dim ** -0.5, dtype=dtype,
                          sliding_window=layer_sliding_window(config, i))
            for i in range(config.num_hidden_layers)]


class LlamaAttention(nn.Module):
    """Returns this shard's partial sum of the output projection (the layer reduces it)."""

    def __init__(self, config: Any, kernel: AttentionKernel, dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        spec, shard = kernel.spec, attention_shard(config, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        # Qwen2 (and Qwen2-MoE's qkv_bias): q/k/v bias without an o bias
        is_qwen2 = config.model_type == "qwen2" or bool(getattr(config, "qkv_bias", False))
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = merged_column_parallel(config.hidden_size, (self.q_size, self.kv_size, self.kv_size),
                                               is_qwen2 or attention_bias, dtype, tp,
                                               (shard.q_rows, shard.kv_rows, shard.kv_rows))
        self.o_proj = row_parallel(shard.q_rows.full, config.hidden_size, attention_bias and not is_qwen2, dtype, tp)
        self.q_norm = self.k_norm = None
        if config.model_type in QK_NORM_MODEL_TYPES:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.attn = PagedAttention(kernel)
        self.rotary = apply_rotary  # a backend may point this at a fused kernel with the same contract

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        v = qkv[:, self.q_size + self.kv_size:].reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        if self.q_norm is None:  # one rotary call for the query and key heads together
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                           self.head_dim)
            qk = apply_partial_rotary(self.rotary, qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:].contiguous()
        else:
            q = self.q_norm(qkv[:, :self.q_size].reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size]
                            .reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q = apply_partial_rotary(self.rotary, q, cos, sin)
            k = apply_partial_rotary(self.rotary, k, cos, sin).contiguous()
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """Column-parallel gate/up, row-parallel down: returns this shard's partial sum."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = merged_column_parallel(config.hidden_size, (size, size), bias, dtype, tp)
        self.act = SiluAndMul()
        self.down_proj = row_parallel(size, config.hidden_size, bias, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, kernel: AttentionKernel, dtype: torch.dtype, layer_idx: int = 0,
                 tp: TensorParallel = NO_TP):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(config, kernel, dtype, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = self.build_mlp(config, layer_idx, dtype, tp)

    def build_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        """The feed-forward block of this layer (mixture-of-experts models override it); it
        returns this shard's partial sum."""
        return LlamaMLP(config, dtype, tp)

    def forward(self, hidden, cos, sin, kv_cache, meta):
        hidden = hidden + self.tp.reduce(self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta))
        return hidden + self.tp.reduce(self.mlp(self.post_attention_layernorm(hidden)))


class LlamaModel(nn.Module):
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: Any, kernels: list[AttentionKernel], dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        self.embed_tokens = parallel_embedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.rotary_emb = RotaryEmbedding(rotary_dim(config, head_dim_of(config)), *rope_parameters(config))
        self.layers = nn.ModuleList(self.layer_class(config, kernel, dtype, i, tp) for i, kernel in enumerate(kernels))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids, positions, kv_caches, meta):
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.norm(hidden)


class LlamaForCausalLM(CausalLM):
    """Build it under `with torch.device(device):`; parameters start uninitialised
    (see core/layers/linear.py) and are filled by `load_weights` or dummy init.
    `tp`: this shard of a tensor-parallel group (default: the whole model)."""
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, config: Any, make_kernel: KernelFactory, block_size: int, dtype: torch.dtype,
                 tp: TensorParallel = NO_TP):
        super().__init__()
        self.config, self.tp = config, tp
        self.attention_specs = attention_specs(config, block_size, dtype, tp)
        kernels: dict[AttentionSpec, AttentionKernel] = {}
        for spec in self.attention_specs:
            if spec not in kernels:
                kernels[spec] = make_kernel(spec)
        self.model = self.model_class(config, [kernels[spec] for spec in self.attention_specs], dtype, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = parallel_lm_head(config.hidden_size, config.vocab_size, dtype, tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fit_context(self, max_model_len: int) -> None:
        """Called by the loader with the served context length (longrope picks its factors)."""
        self.model.rotary_emb.fit_context(max_model_len)

    def output_head(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size] (model dtype)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def decoder_layout(self) -> DecoderLayout | None:
        """This model's decoder as core/models/layout.py declares it, or None when it is not
        exactly that shape (tensor-parallel shards, mixture-of-experts layers)."""
        model, spec = self.model, self.attention_specs[0]
        if self.tp.world_size > 1 or any(type(layer.mlp) is not LlamaMLP for layer in model.layers):
            return None
        layers = tuple(LayerParts(layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                  layer.post_attention_layernorm, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                                  layer.self_attn.q_norm, layer.self_attn.k_norm, s.sliding_window)
                       for layer, s in zip(model.layers, self.attention_specs, strict=True))
        return DecoderLayout(model.embed_tokens, model.rotary_emb, layers, model.norm, self.config.hidden_size,
                             spec.num_heads,
                             spec.num_kv_heads, spec.head_dim, rotary_dim(self.config, spec.head_dim),
                             model.norm.eps, spec.scale, spec.soft_cap)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (select the rows you need first) -> float32 [N, vocab]
        (sharded: every shard's vocabulary slice, gathered in rank order)."""
        return self.tp.gather_logits(self.lm_head(hidden), self.config.vocab_size).float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy (Hugging Face name, tensor) pairs into the parameters (this shard's slices of
        them); returns the names of the parameters now fully loaded. Unknown names raise."""
        loaded = load_checkpoint_weights(self, weights, STACKED_PARAMS, self.tie_word_embeddings)
        if self.tie_word_embeddings:
            self.lm_head.tie_quantized(self.model.embed_tokens)
        return loaded
