"""What a model declares about its decoder so a backend may run the layers its own way.

`DecoderLayout` is the Llama shape: pre-norm layers of RMSNorm -> fused q/k/v projection ->
(per-head q/k RMSNorm) -> rotary -> paged attention -> output projection -> residual, then
RMSNorm -> fused gate/up -> silu(gate) * up -> down -> residual; a final RMSNorm. A model
whose decoder is exactly that returns one from `decoder_layout()` (None otherwise: other
layer shapes, mixture-of-experts layers, tensor-parallel shards); a backend that runs whole
decode steps itself (backends/cpu/fused_decode.py) reads the modules named here, after its
prepare_model swapped in its kernels, and must compute what the model's forward computes.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LayerParts:
    input_norm: nn.Module  # RMSNorm (weight, eps)
    qkv: nn.Module  # x [T, hidden] -> [T, (heads + 2 kv_heads) * head_dim], q then k then v
    o: nn.Module
    post_norm: nn.Module
    gate_up: nn.Module  # x -> [T, 2 * intermediate], gate then up
    down: nn.Module
    q_norm: nn.Module | None  # per-head RMSNorm of q and k before rotary (Qwen3), or None
    k_norm: nn.Module | None
    sliding_window: int | None


@dataclass(frozen=True)
class DecoderLayout:
    embed: nn.Module  # input_ids [T] -> [T, hidden]
    rotary: nn.Module  # RotaryEmbedding: (positions, dtype) -> cos, signed sin [T, 1, rotary_dim]
    layers: tuple[LayerParts, ...]
    norm: nn.Module  # the final RMSNorm
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    eps: float  # of every RMSNorm
    scale: float  # attention scale
    soft_cap: float | None  # attention logits soft cap
