"""The projector types an mmproj file may hold (llama.cpp's `clip.projector_type`), one class each
(the base, `Projector`, and what each says: mmproj_base.py); mmproj.py reads and checks a file with
the class that `PROJECTORS` gives for its type, and nothing else there depends on the type.

Served: Idefics3 / SmolVLM ("idefics3", conversion/smolvlm.py) and Gemma 3 ("gemma3",
conversion/gemma.py Gemma3VisionModel), here; Qwen2-VL ("qwen2vl_merger") and Qwen2.5-VL
("qwen2.5vl_merger", conversion/qwenvl.py Qwen2VLVisionModel), mmproj_qwen2_vl.py.
"""
from __future__ import annotations

from typing import Any

import torch

from ..models.plain_config import PlainConfig
from .mmproj_base import BILINEAR, LANCZOS, Metadata, MmprojError, Projector
from .mmproj_base import normalization as _normalization
from .mmproj_qwen2_vl import Qwen2VLProjector, Qwen25VLProjector

__all__ = ["PROJECTORS", "MmprojError", "Projector"]


def _siglip(model_type: str, required: Metadata, optional: Metadata, activation: str) -> dict[str, Any]:
    """A SigLIP tower's config from the clip.vision.* keys (conversion/base.py MmprojModel)."""
    return {
        "model_type": model_type, "num_channels": 3,
        "image_size": int(required("clip.vision.image_size")), "patch_size": int(required("clip.vision.patch_size")),
        "hidden_size": int(required("clip.vision.embedding_length")),
        "intermediate_size": int(required("clip.vision.feed_forward_length")),
        "num_hidden_layers": int(required("clip.vision.block_count")),
        "num_attention_heads": int(required("clip.vision.attention.head_count")),
        "layer_norm_eps": float(optional("clip.vision.attention.layer_norm_epsilon") or 1e-6),
        "hidden_act": activation,
    }


def _dividing(value: int, vision: dict[str, Any], what: str) -> int:
    side = vision["image_size"] // vision["patch_size"]
    if value < 1 or side % value:
        raise MmprojError(f"{what} {value} does not divide the {side}x{side} patch grid")
    return int(value)


class Idefics3Projector(Projector):
    """Idefics3 / SmolVLM: SigLIP with bucketed positions, a pixel-shuffle connector; images cut
    into tiles of the tower's size plus a global view, resized with LANCZOS (clip.cpp's)."""

    projector_type, label = "idefics3", "Idefics3, SmolVLM"
    model_type, architecture, image_token = "idefics3", "Idefics3ForConditionalGeneration", "<image>"
    tied_by_default = False
    projection = "mm.model.fc.weight"
    # a file without clip.vision.preproc_image_size (older converters): transformers' default, an
    # image resized to at most 4 tiles a side before it is cut
    default_tiles_per_side = 4

    def vision_config(self, required, optional, activation, tensors):
        return _siglip("idefics3_vision", required, optional, activation)

    def scale_factor(self, optional, vision, projection):
        value = optional("clip.vision.projector.scale_factor")
        if value is None:  # what the projection's input width implies
            value = round((projection[1] / vision["hidden_size"]) ** 0.5)
        return _dividing(int(value), vision, "scale factor")

    def shape_config(self, vision, scale_factor, text_hidden):
        return PlainConfig({"vision_config": vision, "scale_factor": scale_factor,
                            "text_config": PlainConfig({"hidden_size": text_hidden})})

    def expected_shapes(self, config):
        from ..models.siglip import PixelShuffleConnector, VisionTransformer

        vision = config.vision_config
        with torch.device("meta"):
            modules = {"model.vision_model.": VisionTransformer(vision),
                       "model.connector.": PixelShuffleConnector(vision.hidden_size, config.text_config.hidden_size,
                                                                 int(config.scale_factor))}
        return {prefix + key: tuple(value.shape) for prefix, module in modules.items()
                for key, value in module.state_dict().items()}

    def width(self, projection):
        return projection[0]  # nn.Linear: [out, in]

    def processor_config(self, required, optional, vision, scale_factor):
        image_size, patch_size = vision["image_size"], vision["patch_size"]
        longest_edge = optional("clip.vision.preproc_image_size") or self.default_tiles_per_side * image_size
        return {"image_processor": {"do_image_splitting": True, "resample": LANCZOS,
                                    "size": {"longest_edge": int(longest_edge)},
                                    "max_image_size": {"longest_edge": image_size}, **_normalization(required)},
                "image_seq_len": (image_size // patch_size) ** 2 // scale_factor ** 2}

    def composite(self, vision, scale_factor, vocab, text_name):
        return {"scale_factor": scale_factor, "image_token_id": self.token_id(vocab, self.image_token, text_name)}


class Gemma3Projector(Projector):
    """Gemma 3: SigLIP with its own positions (one frame of the tower's size), the projector's
    average pool over scale_factor x scale_factor patches (4 unless the file says), RMSNorm
    (1 + weight: the converter stores the +1), a [vision hidden, text hidden] matrix (stored as
    the checkpoint has it, its "_weight" named ".weight"); images resized to the tower's size
    with BILINEAR (clip.cpp's, transformers' Gemma3ImageProcessor's), no pan-and-scan."""

    projector_type, label = "gemma3", "Gemma 3"
    model_type, architecture, image_token = "gemma3", "Gemma3ForConditionalGeneration", "<image_soft_token>"
    boi_token, eoi_token = "<start_of_image>", "<end_of_image>"
    tied_by_default = True
    projection = "mm.input_projection.weight"
    default_scale_factor = 4  # clip.cpp's (all Gemma 3 sizes); written only where it differs
    _matrix = "multi_modal_projector.mm_input_projection_weight"
    _norm = "multi_modal_projector.mm_soft_emb_norm.weight"

    def vision_config(self, required, optional, activation, tensors):
        return _siglip("siglip_vision_model", required, optional, activation)

    def scale_factor(self, optional, vision, projection):
        value = optional("clip.vision.projector.scale_factor") or self.default_scale_factor
        return _dividing(int(value), vision, "scale factor")

    def shape_config(self, vision, scale_factor, text_hidden):
        side = vision.image_size // vision.patch_size // scale_factor
        return PlainConfig({"vision_config": vision, "mm_tokens_per_image": side * side,
                            "text_config": PlainConfig({"hidden_size": text_hidden})})

    def expected_shapes(self, config):
        from ..models.gemma3_vision import Gemma3Projector as Module
        from ..models.siglip import FullGridVisionTransformer

        with torch.device("meta"):
            modules = {"vision_tower.vision_model.": FullGridVisionTransformer(config.vision_config),
                       "multi_modal_projector.": Module(config)}
        return {prefix + key: tuple(value.shape) for prefix, module in modules.items()
                for key, value in module.state_dict().items()}

    def width(self, projection):
        return projection[1]  # [vision hidden, text hidden]

    def lookup_name(self, parameter):
        return parameter.replace("_weight", ".weight") if parameter == self._matrix else parameter

    def from_stored(self, parameter, parts):
        return parts[0] - 1.0 if parameter == self._norm else parts[0]

    def processor_config(self, required, optional, vision, scale_factor):
        image_size = vision["image_size"]
        return {"image_processor": {"size": {"height": image_size, "width": image_size}, "resample": BILINEAR,
                                    "do_pan_and_scan": False, **_normalization(required)},
                "image_seq_length": (image_size // vision["patch_size"] // scale_factor) ** 2,
                "boi_token": self.boi_token, "eoi_token": self.eoi_token, "image_token": self.image_token}

    def composite(self, vision, scale_factor, vocab, text_name):
        image_token_id = self.token_id(vocab, self.image_token, text_name)
        side = vision["image_size"] // vision["patch_size"] // scale_factor
        return {"mm_tokens_per_image": side * side, "image_token_id": image_token_id,
                "image_token_index": image_token_id,
                "boi_token_index": self.token_id(vocab, self.boi_token, text_name),
                "eoi_token_index": self.token_id(vocab, self.eoi_token, text_name)}


# clip.projector_type -> its class: the one place a file's type is decided
PROJECTORS: dict[str, Projector] = {p.projector_type: p for p in (Idefics3Projector(), Gemma3Projector(),
                                                                  Qwen2VLProjector(), Qwen25VLProjector())}
