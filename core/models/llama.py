"""Llama-family decoder in plain torch: Llama, Mistral, Qwen2 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm), SmolLM.

The flat batch holds every scheduled token of every request, no padding:
input_ids and positions are [T]; the attention call site (PagedAttention) reads the
per-request layout from AttentionMetadata. Weights use Hugging Face names, with
q/k/v and gate/up fused into one projection each (`load_weights` fills the slices).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..backend import AttentionKernel, AttentionMetadata, AttentionSpec
from ..layers import (Embedding, Linear, MergedLinear, PagedAttention, RMSNorm, RotaryEmbedding,
                      SiluAndMul, apply_rotary, rope_parameters)
from ..layers.rotary import apply_partial_rotary, rotary_dim

KernelFactory = Callable[[AttentionSpec], AttentionKernel]

# Hugging Face projection name -> (our fused projection, shard index).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
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


def attention_specs(config: Any, block_size: int, dtype: torch.dtype) -> list[AttentionSpec]:
    """One AttentionSpec per layer (they differ only in sliding_window)."""
    head_dim = head_dim_of(config)
    return [AttentionSpec(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                          head_dim=head_dim, block_size=block_size, scale=head_dim ** -0.5, dtype=dtype,
                          sliding_window=layer_sliding_window(config, i))
            for i in range(config.num_hidden_layers)]


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, kernel: AttentionKernel, dtype: torch.dtype):
        super().__init__()
        spec = kernel.spec
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        # Qwen2 (and Qwen2-MoE's qkv_bias): q/k/v bias without an o bias
        is_qwen2 = config.model_type == "qwen2" or bool(getattr(config, "qkv_bias", False))
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedLinear(config.hidden_size, (self.q_size, self.kv_size, self.kv_size),
                                     bias=is_qwen2 or attention_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=attention_bias and not is_qwen2, dtype=dtype)
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
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, (size, size), bias=bias, dtype=dtype)
        self.act = SiluAndMul()
        self.down_proj = Linear(size, config.hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, kernel: AttentionKernel, dtype: torch.dtype, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(config, kernel, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = self.build_mlp(config, layer_idx, dtype)

    def build_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """The feed-forward block of this layer (mixture-of-experts models override it)."""
        return LlamaMLP(config, dtype)

    def forward(self, hidden, cos, sin, kv_cache, meta):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: Any, kernels: list[AttentionKernel], dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(rotary_dim(config, head_dim_of(config)), *rope_parameters(config))
        self.layers = nn.ModuleList(self.layer_class(config, kernel, dtype, i) for i, kernel in enumerate(kernels))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids, positions, kv_caches, meta):
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Build it under `with torch.device(device):`; parameters start uninitialised
    (see core/layers/linear.py) and are filled by `load_weights` or dummy init."""
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, config: Any, make_kernel: KernelFactory, block_size: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.attention_specs = attention_specs(config, block_size, dtype)
        kernels: dict[AttentionSpec, AttentionKernel] = {}
        for spec in self.attention_specs:
            if spec not in kernels:
                kernels[spec] = make_kernel(spec)
        self.model = self.model_class(config, [kernels[spec] for spec in self.attention_specs], dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fit_context(self, max_model_len: int) -> None:
        """Called by the loader with the served context length (longrope picks its factors)."""
        self.model.rotary_emb.fit_context(max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size] (model dtype)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (select the rows you need first) -> float32 [N, vocab]."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (Hugging Face name, tensor) pairs into the parameters; returns the
        names of the parameters now fully loaded. Unknown names raise."""
        params = dict(self.named_parameters())
        shards_loaded: dict[str, set[int]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_WEIGHT_SUFFIXES) or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            fused = _fused_name(name)
            if fused is not None:
                param_name, shard = fused
                module = self.get_submodule(param_name.rsplit(".", 1)[0])
                module.load_shard(_param(params, param_name), shard, tensor)
                shards_loaded.setdefault(param_name, set()).add(shard)
                if len(shards_loaded[param_name]) == len(module.output_sizes):
                    loaded.add(param_name)
                continue
            param = _param(params, name)
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded


def _fused_name(name: str) -> tuple[str, int] | None:
    for hf_name, (fused, shard) in STACKED_PARAMS.items():
        if f".{hf_name}." in name:
            return name.replace(f".{hf_name}.", f".{fused}."), shard
    return None


def _param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"checkpoint weight {name!r} has no matching parameter in the model")
    return params[name]
