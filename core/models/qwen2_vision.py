"""Qwen2-VL's vision tower in plain torch (transformers' Qwen2VisionTransformerPretrainedModel):
a Conv3d patch embedding over the image processor's flattened patches, blocks of full attention
with a 2D rotary embedding (the patch's row and column), and the PatchMerger, which merges each
2x2 window of patches into one row of the text model's width.

The image processor (Qwen2VLImageProcessor) lays an image's patches out window-major: the
spatial_merge_size**2 patches of one merge window are consecutive, in (t, h/m, w/m, m, m) order,
so the merger's window is a plain reshape. One image is one attention sequence (one temporal
frame: an image has t = 1). Module names are transformers' (`patch_embed.proj`, `blocks.N.norm1`,
`attn.qkv`, `mlp.fc1`, `merger.ln_q`, `merger.mlp.0`, ...), so weights load by name.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "silu": F.silu}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def patch_positions(t: int, h: int, w: int, merge: int, device: torch.device) -> torch.Tensor:
    """The (row, column) of each patch [t*h*w, 2], in the processor's window-major order."""
    rows = torch.arange(h, device=device).view(h, 1).expand(h, w)
    cols = torch.arange(w, device=device).view(1, w).expand(h, w)
    blocks = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(blocks).transpose(1, 2).flatten()
    cols = cols.reshape(blocks).transpose(1, 2).flatten()
    return torch.stack((rows, cols), dim=-1).repeat(t, 1)


class VisionRotary(nn.Module):
    """The 2D rotary embedding: a quarter of each head's dimensions turn with the patch's row, a
    quarter with its column, and the second half repeats the first (rotate-half layout)."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        self.dim, self.theta = head_dim // 2, theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, 2] -> cos, sin [N, head_dim] float32 (made here, not a buffer: the tower
        is built on the meta device and every tensor it keeps comes from the checkpoint)."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float, device=positions.device) / self.dim
        inv_freq = 1.0 / self.theta ** exponents
        freqs = positions[..., None].float() * inv_freq  # [N, 2, head_dim / 4]
        freqs = torch.cat((freqs[:, 0], freqs[:, 1]), dim=-1)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos(), freqs.sin()


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, embed_dim: int):
        super().__init__()
        self.shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=self.shape[1:], stride=self.shape[1:], bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, C*T*P*P] -> [N, embed_dim]."""
        x = patches.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class VisionAttention(nn.Module):
    """Attention over one image's patches, fused qkv with bias: full, or within the windows
    `mask` allows (Qwen2.5-VL's window attention, qwen2_5_vision.py)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = ACTIVATIONS[act]
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        dim = config.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = VisionMlp(dim, int(dim * config.mlp_ratio), config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """A norm (`norm`: LayerNorm here, Qwen2.5-VL's RMSNorm), each merge window's patches side by
    side, a GELU MLP to the text width."""

    def __init__(self, dim: int, context_dim: int, merge: int,
                 norm: Callable[[int], nn.Module] = lambda size: nn.LayerNorm(size, eps=1e-6)):
        super().__init__()
        self.hidden_size = context_dim * merge ** 2
        self.ln_q = norm(context_dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(),
                                 nn.Linear(self.hidden_size, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class Qwen2VisionTransformer(nn.Module):
    """One image's patches [t*h*w, C*T*P*P] and grid (t, h, w) in patches -> its image token
    embeddings [t*h*w / merge**2, text hidden], in the order of its image tokens."""

    def __init__(self, config: Any):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config.patch_size, config.temporal_patch_size, config.in_channels,
                                      config.embed_dim)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary_pos_emb = VisionRotary(config.embed_dim // config.num_heads, theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.hidden_size, config.embed_dim, self.merge)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        if t != 1:
            raise NotImplementedError("video inputs (t > 1) are not served")
        x = self.patch_embed(patches)
        cos, sin = self.rotary_pos_emb(patch_positions(t, h, w, self.merge, x.device))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.merger(x)
