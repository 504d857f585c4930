"""Qwen2-VL's and Qwen2.5-VL's mmproj files (llama.cpp's `clip.projector_type` "qwen2vl_merger",
"qwen2.5vl_merger"; conversion/qwenvl.py Qwen2VLVisionModel), served by the native classes of
core/models/qwen2_vl.py (towers: qwen2_vision.py, qwen2_5_vision.py); registered in
mmproj_projectors.py (PROJECTORS).

What the converter changed, undone here:
- each block's fused qkv (weight and bias) is stored as three tensors, attn_q, attn_k, attn_v (the
  checkpoint's rows in thirds): they are concatenated back;
- the Conv3d patch embedding (temporal_patch_size 2) is stored as two Conv2d kernels,
  `v.patch_embd.weight` (temporal index 0) and `v.patch_embd.weight.1` (index 1): they are stacked
  back along the temporal axis;
- Qwen2-VL's vision config is renamed (embed_dim written as embedding_length, the vision config's
  hidden_size, the merger's output width, as feed_forward_length): the tower's width is
  embedding_length, its MLP width the fc1 tensor's, the merger's output the projection's;
- Qwen2.5-VL's fullatt_block_indexes are written as their period, clip.vision.n_wa_pattern (block
  i attends fully where (i + 1) % n_wa_pattern == 0, as clip.cpp reads it); no window size is
  written: clip.vision.window_size where a file has one, else clip.cpp's 112 pixels (every
  Qwen2.5-VL's); its SiLU MLP is clip.use_silu.
The merge size is clip.vision.spatial_merge_size where a file has one, else 2 (clip.cpp's, every
Qwen2-VL's and Qwen2.5-VL's). Images are prepared as the checkpoints' Qwen2VLImageProcessor:
BICUBIC (clip.cpp's too), the file's patch size, merge size, mean and std, and the checkpoints'
min_pixels and max_pixels (the converter writes none; clip.vision.image_min_pixels /
image_max_pixels where a file has them). llama.cpp clamps images to 8..4096 tokens instead, its
own memory limit, not the model's.
"""
from __future__ import annotations

from typing import Any

import torch

from ..models.plain_config import PlainConfig
from .mmproj_base import BICUBIC, Metadata, MmprojError, Projector, normalization

# the Qwen2-VL / Qwen2.5-VL checkpoints' preprocessor_config.json (every size's)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384
DEFAULT_MERGE = 2  # clip.cpp's, where the file says none
DEFAULT_WINDOW = 112  # clip.cpp's Qwen2.5-VL window, in pixels
TEMPORAL_PATCH = 2  # the converter splits the patch embedding in two Conv2d kernels, no other size
_PATCH = "visual.patch_embed.proj.weight"
_FC1 = "v.blk.0.ffn_up.weight"  # Qwen2-VL's first block's fc1: its MLP width


def _common(required: Metadata, optional: Metadata, activation: str) -> dict[str, Any]:
    return {"in_channels": 3, "patch_size": int(required("clip.vision.patch_size")),
            "temporal_patch_size": TEMPORAL_PATCH,
            "spatial_merge_size": int(optional("clip.vision.spatial_merge_size") or DEFAULT_MERGE),
            "depth": int(required("clip.vision.block_count")),
            "num_heads": int(required("clip.vision.attention.head_count")), "hidden_act": activation}


class Qwen2VLProjector(Projector):
    """Qwen2-VL: a Conv3d patch embedding, LayerNorm blocks with fused qkv and a quick-GELU MLP, a
    2D rotary embedding, the PatchMerger (LayerNorm, each 2x2 window's patches side by side, a GELU
    MLP: mm.0, mm.2); M-RoPE positions (the text GGUF's rope.dimension_sections); images cut into
    14-pixel patches at their own aspect ratio, one `<|image_pad|>` per merged window."""

    projector_type, label = "qwen2vl_merger", "Qwen2-VL"
    model_type, architecture, image_token = "qwen2_vl", "Qwen2VLForConditionalGeneration", "<|image_pad|>"
    start_token, end_token, video_token = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"
    tied_by_default = False
    projection = "mm.2.weight"
    activations = ("quick_gelu",)

    def vision_config(self, required, optional, activation, tensors):
        config = _common(required, optional, activation)
        width, fc1 = int(required("clip.vision.embedding_length")), tensors.get(_FC1)
        if fc1 is None or len(fc1) != 2 or tensors.get(self.projection) is None:
            raise MmprojError(f"no {_FC1} or {self.projection} tensor, which give the tower's MLP and output widths")
        return {"model_type": "qwen2_vl", **config, "embed_dim": width, "mlp_ratio": fc1[0] / width,
                "hidden_size": tensors[self.projection][0]}

    def scale_factor(self, optional, vision, projection):
        return int(vision["spatial_merge_size"])

    def shape_config(self, vision, scale_factor, text_hidden):
        return PlainConfig({"vision_config": vision})

    def tower(self, vision: Any) -> torch.nn.Module:
        from ..models.qwen2_vision import Qwen2VisionTransformer

        return Qwen2VisionTransformer(vision)

    def expected_shapes(self, config):
        with torch.device("meta"):
            tower = self.tower(config.vision_config)
        return {"visual." + key: tuple(value.shape) for key, value in tower.state_dict().items()}

    def width(self, projection):
        return projection[0]  # nn.Linear: [out, in]

    def block_count(self, vision):
        return int(vision.depth)

    def parts(self, parameter, shape, gguf_name):
        if ".attn.qkv." in parameter:  # q, k, v: the rows in thirds
            return [(gguf_name(parameter.replace(".qkv.", f".{part}.")), (shape[0] // 3, *shape[1:]))
                    for part in "qkv"]
        if parameter == _PATCH:  # [out, C, T, P, P]: the kernel of each temporal index, 0 then 1
            name, kernel = gguf_name(parameter), (shape[0], shape[1], *shape[3:])
            return [(name, kernel)] + [(f"{name}.{t}", kernel) for t in range(1, shape[2])]
        return super().parts(parameter, shape, gguf_name)

    def from_stored(self, parameter, parts):
        if ".attn.qkv." in parameter:
            return torch.cat(parts, dim=0)
        if parameter == _PATCH:
            return torch.stack(parts, dim=2)
        return parts[0]

    def processor_config(self, required, optional, vision, scale_factor):
        return {"image_processor": {
            "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": scale_factor, "resample": BICUBIC,
            "min_pixels": int(optional("clip.vision.image_min_pixels") or MIN_PIXELS),
            "max_pixels": int(optional("clip.vision.image_max_pixels") or MAX_PIXELS), **normalization(required)}}

    def composite(self, vision, scale_factor, vocab, text_name):
        ids = {"image_token_id": self.token_id(vocab, self.image_token, text_name),
               "vision_start_token_id": self.token_id(vocab, self.start_token, text_name),
               "vision_end_token_id": self.token_id(vocab, self.end_token, text_name)}
        if self.video_token in vocab:
            ids["video_token_id"] = int(vocab[self.video_token])
        return ids


class Qwen25VLProjector(Qwen2VLProjector):
    """Qwen2.5-VL: Qwen2-VL's layout and image preparation, with RMSNorm (blocks' and merger's, no
    bias), a SwiGLU MLP with bias (ffn_gate, ffn_up, ffn_down), window attention but in the
    blocks of n_wa_pattern."""

    projector_type, label = "qwen2.5vl_merger", "Qwen2.5-VL"
    model_type, architecture = "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"
    activations = ("silu",)

    def vision_config(self, required, optional, activation, tensors):
        config = _common(required, optional, activation)
        period = int(required("clip.vision.n_wa_pattern"))
        if period < 1 or tensors.get(self.projection) is None:
            raise MmprojError(f"window attention period {period} or no {self.projection} tensor")
        return {"model_type": "qwen2_5_vl", **config, "hidden_size": int(required("clip.vision.embedding_length")),
                "intermediate_size": int(required("clip.vision.feed_forward_length")),
                "out_hidden_size": tensors[self.projection][0],
                "window_size": int(optional("clip.vision.window_size") or DEFAULT_WINDOW),
                "fullatt_block_indexes": [i for i in range(config["depth"]) if (i + 1) % period == 0]}

    def tower(self, vision):
        from ..models.qwen2_5_vision import Qwen25VisionTransformer

        return Qwen25VisionTransformer(vision)
