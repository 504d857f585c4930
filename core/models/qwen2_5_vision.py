"""Qwen2.5-VL's vision tower in plain torch (transformers' Qwen2_5_VisionTransformerPretrainedModel):
Qwen2-VL's (qwen2_vision.py: the Conv3d patch embedding, the 2D rotary embedding, the attention)
with RMSNorm in place of LayerNorm (the blocks' and the merger's `ln_q`), a SwiGLU MLP with bias,
and window attention: every block but those of `fullatt_block_indexes` attends within windows of
window_size pixels a side (window_size / merge / patch merged units).

For window attention the merge units (a 2x2 window of patches each, consecutive in the
processor's order) are reordered window by window (transformers' get_vision_window_index), the
tower runs in that order, and the merger's rows are put back in the image tokens' order. Module
names are transformers' (`blocks.N.mlp.gate_proj`, `merger.ln_q.weight`, ...).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .qwen2_vision import ACTIVATIONS, PatchEmbed, PatchMerger, VisionAttention, VisionRotary, patch_positions


class VisionRMSNorm(nn.Module):
    """Qwen2_5_VLRMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class SwiGluMlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim)
        self.up_proj = nn.Linear(dim, hidden_dim)
        self.down_proj = nn.Linear(hidden_dim, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        dim = config.hidden_size
        self.norm1 = VisionRMSNorm(dim)
        self.norm2 = VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = SwiGluMlp(dim, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


def window_order(t: int, h: int, w: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge units of a (t, h, w) grid (in merged units) window by window: (their indices in
    that order, the window of each)."""
    index = torch.arange(t * h * w).reshape(t, h, w)
    pad_h, pad_w = -h % window, -w % window
    index = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    rows, cols = (h + pad_h) // window, (w + pad_w) // window
    index = index.reshape(t, rows, window, cols, window).permute(0, 1, 3, 2, 4).reshape(-1, window * window)
    windows = torch.arange(index.shape[0]).unsqueeze(1).expand_as(index)
    kept = index >= 0
    return index[kept], windows[kept]


class Qwen25VisionTransformer(nn.Module):
    """One image's patches [t*h*w, C*T*P*P] and grid (t, h, w) in patches -> its image token
    embeddings [t*h*w / merge**2, text hidden], in the order of its image tokens."""

    def __init__(self, config: Any):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window = config.window_size // self.merge // config.patch_size
        self.full_blocks = frozenset(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config.patch_size, config.temporal_patch_size, config.in_channels,
                                      config.hidden_size)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary_pos_emb = VisionRotary(config.hidden_size // config.num_heads, theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, self.merge, VisionRMSNorm)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        if t != 1:
            raise NotImplementedError("video inputs (t > 1) are not served")
        unit = self.merge ** 2
        x = self.patch_embed(patches)
        order, windows = window_order(t, h // self.merge, w // self.merge, self.window)
        order, windows = order.to(x.device), windows.to(x.device)

        def windowed(rows: torch.Tensor) -> torch.Tensor:  # merge units in window order
            return rows.reshape(-1, unit, rows.shape[-1])[order].reshape(-1, rows.shape[-1])

        x = windowed(x)
        cos, sin = (windowed(table) for table in self.rotary_pos_emb(patch_positions(t, h, w, self.merge, x.device)))
        segment = windows.repeat_interleave(unit)
        window_mask = segment.unsqueeze(0) == segment.unsqueeze(1)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if i in self.full_blocks else window_mask)
        return self.merger(x)[torch.argsort(order)]
