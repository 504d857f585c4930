"""Rotary position embeddings (the Hugging Face "rotate half" layout).

Supported rope types: "default", "linear" and "llama3" (Llama 3.1 frequency
scaling); anything else raises NotImplementedError rather than run wrong.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> tuple[float, dict]:
    """(rope_theta, scaling dict with at least "rope_type") of a transformers config,
    from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        if "rope_theta" not in params:
            raise NotImplementedError(f"per-layer-type rope parameters are not supported: {params}")
        theta, scaling = params["rope_theta"], dict(params)
    else:
        theta = getattr(config, "rope_theta", 10000.0)
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), scaling


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    rope_type = scaling.get("rope_type", "default")
    inv_freq = _default_inv_freq(head_dim, theta)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise NotImplementedError(
        f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """Computes, once per step, cos and a sign-folded sin for the step's positions,
    in the model dtype and shaped [T, 1, head_dim] for every layer's `apply_rotary`."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, theta, scaling or {})
        # Built on the current default device; float32 whatever the model dtype.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        # rotate_half(x) * sin == roll(x, D/2) * cat(-sin, sin): the sign lives in the table.
        cos_table = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        sin_table = torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return cos_table, sin_table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] ("rotate half" layout); tables from RotaryEmbedding.
    Same elementwise arithmetic as Hugging Face's x * cos + rotate_half(x) * sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
