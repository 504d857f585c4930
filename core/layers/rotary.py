"""Rotary position embeddings (the Hugging Face "rotate half" layout).

Rope types, computed as transformers computes them (modeling_rope_utils.py):
"default"; "linear"; "dynamic" (NTK: identical to default up to max_position_embeddings,
and the loader never serves past that); "llama3" (Llama 3.1 frequency scaling);
"yarn" (ramped interpolation and an attention factor on cos/sin); "longrope"
(Phi-3's "su": per-dimension short and long factors and an attention factor; the model
picks one set for its served context, RotaryEmbedding.fit_context). Anything
else raises NotImplementedError rather than run wrong. A partial rotary factor rotates
only the first `rotary_dim` dimensions of each head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(config: Any) -> tuple[float, dict]:
    """(rope_theta, scaling dict with at least "rope_type") of a transformers config,
    from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x).
    "su" (early Phi-3 configs) reads as "longrope"."""
    params = getattr(config, "rope_parameters", None)
    if params:
        if "rope_theta" not in params:
            raise NotImplementedError(f"per-layer-type rope parameters are not supported: {params}")
        theta, scaling = params["rope_theta"], dict(params)
    else:
        theta = getattr(config, "rope_theta", 10000.0)
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling["rope_type"] == "su":
        scaling["rope_type"] = "longrope"
    if scaling["rope_type"] in ("yarn", "longrope"):  # context lengths from the config where the dict lacks them
        for key in ("original_max_position_embeddings", "max_position_embeddings"):
            if scaling.get(key) is None:
                scaling[key] = getattr(config, key, None)
    return float(theta), scaling


def rotary_dim(config: Any, head_dim: int) -> int:
    """How many leading dimensions of each head rotate (`partial_rotary_factor`)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * (factor if factor is not None else 1.0))


@dataclass(frozen=True)
class RopeFrequencies:
    inv_freq: torch.Tensor  # [dim / 2] float32
    attention_scaling: float = 1.0  # multiplies cos and sin (yarn, longrope)
    long_inv_freq: torch.Tensor | None = None  # longrope: for sequences past original_max
    original_max_position_embeddings: int | None = None


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
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


def _original_max(scaling: dict) -> int:
    original = scaling.get("original_max_position_embeddings") or scaling.get("max_position_embeddings")
    if original is None:
        raise ValueError(f"rope type {scaling['rope_type']!r} needs original_max_position_embeddings")
    return int(original)


def _factor(scaling: dict) -> float:
    factor = scaling.get("factor")
    if factor is None:  # transformers: the ratio of the extended to the original context
        factor = scaling["max_position_embeddings"] / _original_max(scaling)
    return float(factor)


def _yarn(dim: int, theta: float, scaling: dict) -> RopeFrequencies:
    factor, original = _factor(scaling), _original_max(scaling)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return RopeFrequencies(inv_freq, float(attention))


def _longrope(dim: int, theta: float, scaling: dict) -> RopeFrequencies:
    original = _original_max(scaling)
    factor = _factor(scaling)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta ** shape)
                   for key in ("short_factor", "long_factor"))
    return RopeFrequencies(short, float(attention), long, original)


def rope_frequencies(dim: int, theta: float, scaling: dict) -> RopeFrequencies:
    """The frequencies of `dim` rotated dimensions for a scaling dict from rope_parameters."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        return RopeFrequencies(_default_inv_freq(dim, theta))
    if rope_type == "linear":
        return RopeFrequencies(_default_inv_freq(dim, theta) / scaling["factor"])
    if rope_type == "llama3":
        return RopeFrequencies(_llama3_inv_freq(_default_inv_freq(dim, theta), scaling))
    if rope_type == "yarn":
        return _yarn(dim, theta, scaling)
    if rope_type == "longrope":
        return _longrope(dim, theta, scaling)
    raise NotImplementedError(
        f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def compute_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    return rope_frequencies(head_dim, theta, scaling).inv_freq


class RotaryEmbedding(nn.Module):
    """Computes, once per step, cos and a sign-folded sin for the step's positions,
    in the model dtype and shaped [T, 1, dim] for every layer's `apply_rotary`."""

    def __init__(self, dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        frequencies = rope_frequencies(dim, theta, scaling or {})
        # Built on the current default device; float32 whatever the model dtype.
        self.register_buffer("inv_freq", frequencies.inv_freq, persistent=False)
        self.attention_scaling = frequencies.attention_scaling
        self.original_max = frequencies.original_max_position_embeddings
        # longrope: the long factors serve every token once the served context passes the
        # original one (see fit_context): one choice per model, so cached keys never mix factors.
        self.register_buffer("long_inv_freq", frequencies.long_inv_freq, persistent=False)  # None unless longrope
        self.uses_long_factors = frequencies.long_inv_freq is not None

    def fit_context(self, max_model_len: int) -> None:
        """longrope: short factors if no request can outgrow the original context, else long ones.
        (transformers switches a sequence to the long factors when it outgrows it, recomputing
        its cache; a paged cache shared between requests cannot, so vLLM decides per model too.)"""
        if self.long_inv_freq is not None:
            self.uses_long_factors = max_model_len > self.original_max

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.long_inv_freq if self.uses_long_factors else self.inv_freq
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        # rotate_half(x) * sin == roll(x, D/2) * cat(-sin, sin): the sign lives in the table.
        cos_table = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        sin_table = torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return cos_table, sin_table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] ("rotate half" layout); tables from RotaryEmbedding.
    Same elementwise arithmetic as Hugging Face's x * cos + rotate_half(x) * sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def apply_partial_rotary(rotary: Any, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rotary` (apply_rotary or a fused kernel with its contract) on the first cos.shape[-1]
    dimensions of each head; the rest pass through."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return rotary(x, cos, signed_sin)
    return torch.cat((rotary(x[..., :dim], cos, signed_sin), x[..., dim:]), dim=-1)
