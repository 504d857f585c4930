"""SigLIP's vision transformer as Idefics3 / SmolVLM use it, and their pixel-shuffle connector,
in plain torch (transformers' module names, so checkpoints load by name). Gemma 3's tower is the
same transformer with SigLIP's own position embeddings (FullGridVisionTransformer: one fixed frame
size, each patch at its own grid position); its projector is in gemma3_vision.py.

An image arrives as its processor's frames, [F, 3, S, S] (the tiles and the global view of one
image, every frame the same size); each frame is cut into patches, embedded with the position
embedding of its bucketed place in the grid (Idefics3's variable-resolution rule: a frame smaller
than the tower's image size spreads over its positions), encoded with bidirectional attention,
then the connector shuffles each 2x2 (scale_factor) group of patches into one token and projects
it to the text model's width: [F * patches / scale_factor**2, text hidden]. The tower runs on the
backend's device, in the model's dtype, once per image (core/multimodal/encoder_cache.py).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class VisionEmbeddings(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.patch_size = config.patch_size
        self.num_patches_per_side = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         config.patch_size, padding="valid")
        self.position_embedding = nn.Embedding(self.num_patches_per_side ** 2, config.hidden_size)

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """The bucketed position of each patch of a full rows x cols frame (Idefics3's rule)."""
        side = self.num_patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)

        def buckets(n: int) -> torch.Tensor:
            coords = torch.clamp(torch.arange(n, device=device, dtype=torch.float32) * (1.0 / n), max=1.0 - 1e-6)
            return torch.bucketize(coords, boundaries, right=True)

        return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).reshape(-1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        embeddings = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        rows, cols = pixels.shape[2] // self.patch_size, pixels.shape[3] // self.patch_size
        return embeddings + self.position_embedding(self.position_ids(rows, cols, pixels.device))


class FullGridEmbeddings(VisionEmbeddings):
    """SigLIP's own rule (Gemma 3's tower): a frame is exactly image_size a side, and each patch
    takes the position embedding of its own place in the grid, row after row."""

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        side = self.num_patches_per_side
        if (rows, cols) != (side, side):
            raise ValueError(f"a frame of {rows}x{cols} patches for a tower of {side}x{side}")
        return torch.arange(rows * cols, device=device)


class VisionAttention(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        size = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, size // config.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(size, size), nn.Linear(size, size)
        self.v_proj, self.out_proj = nn.Linear(size, size), nn.Linear(size, size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        frames, length, _ = hidden.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(frames, length, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(hidden)), heads(self.k_proj(hidden)),
                                             heads(self.v_proj(hidden)), scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(frames, length, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(f"vision hidden_act {config.hidden_act!r} is not supported")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class VisionEncoder(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))


class VisionTransformer(nn.Module):
    """Frames [F, 3, H, W] -> patch states [F, patches, vision hidden]. `embeddings_class`: how
    patches take their position embeddings (Idefics3's bucketed grid by default)."""

    embeddings_class: type[VisionEmbeddings] = VisionEmbeddings

    def __init__(self, config: Any):
        super().__init__()
        self.embeddings = self.embeddings_class(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixels)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)


class FullGridVisionTransformer(VisionTransformer):
    """SigLIP with its own position embeddings (Gemma 3): frames of exactly image_size."""

    embeddings_class = FullGridEmbeddings


class ModalityProjection(nn.Module):
    def __init__(self, in_size: int, out_size: int):
        super().__init__()
        self.proj = nn.Linear(in_size, out_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class PixelShuffleConnector(nn.Module):
    """Patch states [F, patches, d] -> text-width tokens [F, patches / s**2, text hidden]."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int):
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = ModalityProjection(vision_hidden * scale_factor ** 2, text_hidden)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        frames, seq, dim = x.shape
        side, s = int(seq ** 0.5), self.scale_factor
        x = x.view(frames, side, side // s, dim * s).permute(0, 2, 1, 3)
        x = x.reshape(frames, side // s, side // s, dim * s * s).permute(0, 2, 1, 3)
        return x.reshape(frames, seq // (s * s), dim * s * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(self.pixel_shuffle(x))
