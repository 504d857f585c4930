"""Gemma 2 and Gemma 3 text decoders in plain torch.

Same shape as llama.py (flat token batch, one PagedAttention call site per layer, q/k/v
and gate/up fused, Hugging Face weight names), plus what Gemma adds:
- embeddings scaled by sqrt(hidden_size) (in the model dtype, as transformers does);
- RMSNorm with a (1 + weight) scale in float32 (OffsetRMSNorm), before and after both the
  attention and the MLP of every layer;
- a GeGLU MLP (gelu_pytorch_tanh(gate) * up);
- attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- interleaved sliding-window and global layers (config.layer_types);
- Gemma 2: attention logits soft-capped (attn_logit_softcapping), done by the backend kernel
  through AttentionSpec.soft_cap; Gemma 3 does not cap them (transformers' Gemma 3 ignores
  the field, and so do we);
- Gemma 3: q/k RMSNorm per head, and rope parameters per layer type (a local base, e.g.
  10k, for sliding layers, the global one with its scaling for full-attention layers);
- both: final logits soft-capped (final_logit_softcapping; 30 for Gemma 2, none for Gemma 3).
Tensor parallelism as in llama.py: the post-norms of attention and MLP come after the reduce.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..backend_contract import AttentionKernel, AttentionMetadata, AttentionSpec
from ..layers import PagedAttention, RotaryEmbedding, apply_rotary, rope_parameters
from ..layers.gelu import GeluAndMul
from ..layers.offset_norm import OffsetRMSNorm
from ..layers.parallel import (NO_TP, TensorParallel, VocabParallelEmbedding, merged_column_parallel,
                               parallel_lm_head, row_parallel)
from ..layers.scaled_embedding import ScaledEmbedding, embedding_scale
from .base import CausalLM
from .llama import KernelFactory, LlamaForCausalLM, attention_shard, head_dim_of, layer_sliding_window

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")


def _has_qk_norm(config: Any) -> bool:
    return config.model_type == "gemma3_text"


def gemma_attention_specs(config: Any, block_size: int, dtype: torch.dtype, tp: TensorParallel = NO_TP
                          ) -> list[AttentionSpec]:
    """One AttentionSpec per layer: sliding or global, Gemma's scale, Gemma 2's soft cap;
    this shard's heads."""
    head_dim, shard = head_dim_of(config), attention_shard(config, tp)
    soft_cap = getattr(config, "attn_logit_softcapping", None) if config.model_type == "gemma2" else None
    return [AttentionSpec(num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                          head_dim=head_dim, block_size=block_size, scale=config.query_pre_attn_scalar ** -0.5,
                          dtype=dtype, sliding_window=layer_sliding_window(config, i), soft_cap=soft_cap)
            for i in range(config.num_hidden_layers)]


def rope_by_layer(config: Any) -> tuple[dict[str, tuple[float, dict]], list[str]]:
    """({rope key: (theta, scaling)}, the rope key of each layer). Gemma 3 configs hold
    rope parameters per layer type; Gemma 2 has one set for every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = list(config.layer_types)
    if "rope_theta" not in params and all(t in params for t in layer_types):
        ropes = {t: (float(params[t]["rope_theta"]), dict(params[t])) for t in dict.fromkeys(layer_types)}
        return ropes, layer_types
    return {"all": rope_parameters(config)}, ["all"] * len(layer_types)


class GemmaAttention(nn.Module):
    def __init__(self, config: Any, kernel: AttentionKernel, dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        spec, shard = kernel.spec, attention_shard(config, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = merged_column_parallel(config.hidden_size, (self.q_size, self.kv_size, self.kv_size), bias,
                                               dtype, tp, (shard.q_rows, shard.kv_rows, shard.kv_rows))
        self.o_proj = row_parallel(shard.q_rows.full, config.hidden_size, bias, dtype, tp)
        self.q_norm = self.k_norm = None
        if _has_qk_norm(config):
            self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
            self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.attn = PagedAttention(kernel)
        self.rotary = apply_rotary  # a backend may point this at a fused kernel with the same contract

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = qkv[:, :self.q_size].reshape(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin).contiguous()
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = merged_column_parallel(config.hidden_size, (size, size), False, dtype, tp)
        self.act = GeluAndMul(config.hidden_activation)
        self.down_proj = row_parallel(size, config.hidden_size, False, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around both the attention and the MLP."""

    def __init__(self, config: Any, kernel: AttentionKernel, dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.input_layernorm = OffsetRMSNorm(size, eps, dtype=dtype)
        self.self_attn = GemmaAttention(config, kernel, dtype, tp)
        self.post_attention_layernorm = OffsetRMSNorm(size, eps, dtype=dtype)
        self.pre_feedforward_layernorm = OffsetRMSNorm(size, eps, dtype=dtype)
        self.mlp = GemmaMLP(config, dtype, tp)
        self.post_feedforward_layernorm = OffsetRMSNorm(size, eps, dtype=dtype)

    def forward(self, hidden, cos, sin, kv_cache, meta):
        attended = self.tp.reduce(self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta))
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.tp.reduce(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden + self.post_feedforward_layernorm(fed)


class GemmaModel(nn.Module):
    def __init__(self, config: Any, kernels: list[AttentionKernel], dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        scale = config.hidden_size ** 0.5
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype,
                                                    embedding_scale(scale, dtype)) if tp.sharded else
                             ScaledEmbedding(config.vocab_size, config.hidden_size, scale, dtype=dtype))
        ropes, self.layer_rope_keys = rope_by_layer(config)
        self.rotary_emb = nn.ModuleDict({key: RotaryEmbedding(head_dim_of(config), theta, scaling)
                                         for key, (theta, scaling) in ropes.items()})
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, kernel, dtype, tp) for kernel in kernels)
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids, positions, kv_caches, meta):
        hidden = self.embed_tokens(input_ids)
        tables = {key: rotary(positions, hidden.dtype) for key, rotary in self.rotary_emb.items()}
        for layer, key, kv_cache in zip(self.layers, self.layer_rope_keys, kv_caches, strict=True):
            hidden = layer(hidden, *tables[key], kv_cache, meta)
        return self.norm(hidden)


class GemmaForCausalLM(CausalLM):
    """Gemma 2 (model_type "gemma2") and Gemma 3 text ("gemma3_text"). Same contract as
    LlamaForCausalLM: build under `with torch.device(device):`, then `load_weights`."""

    def __init__(self, config: Any, make_kernel: KernelFactory, block_size: int, dtype: torch.dtype,
                 tp: TensorParallel = NO_TP):
        super().__init__()
        if config.model_type not in GEMMA_MODEL_TYPES:
            raise NotImplementedError(f"GemmaForCausalLM runs {GEMMA_MODEL_TYPES}, not {config.model_type!r}")
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma with use_bidirectional_attention (an embedding model) is not a "
                                      "causal language model and is not supported")
        self.config, self.tp = config, tp
        self.attention_specs = gemma_attention_specs(config, block_size, dtype, tp)
        kernels: dict[AttentionSpec, AttentionKernel] = {}
        for spec in self.attention_specs:
            if spec not in kernels:
                kernels[spec] = make_kernel(spec)
        self.model = GemmaModel(config, [kernels[spec] for spec in self.attention_specs], dtype, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = parallel_lm_head(config.hidden_size, config.vocab_size, dtype, tp)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size] (model dtype)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def decoder_layout(self) -> None:
        """Not the Llama decoder shape of core/models/layout.py: backends run its layers as written."""
        return None

    def output_head(self) -> nn.Module:
        return self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 [N, vocab], soft-capped when the config says so."""
        logits = self.tp.gather_logits(self.lm_head(hidden), self.config.vocab_size).float()
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # Hugging Face names, fused q/k/v and gate/up, tied head: the same rules as the Llama family.
    load_weights = LlamaForCausalLM.load_weights
