"""Qwen2-VL's image family: the checkpoint's Qwen2VLImageProcessor resizes an image to a multiple
of 28 pixels a side (between its min_pixels and max_pixels) and cuts it into 14-pixel patches,
window-major; the chat template writes `<|vision_start|><|image_pad|><|vision_end|>` per image,
and the one `<|image_pad|>` expands into t*h*w / merge_size**2 of them, one per encoder row.

The family runs the image processor alone: transformers' Qwen2VLProcessor also needs its video
processor, which needs torchvision, and nothing here needs more than the image processor (the
expansion is the image token repeated). Registered in families.py (FAMILIES)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .family import Expansion, ImageFamily


@dataclass(frozen=True)
class GridPatches:
    """One image's frames as Qwen2-VL's vision tower takes them (core/models/qwen2_vl.py
    encode_images): the processor's flattened patches [t*h*w, C*T*P*P] and its grid (t, h, w) in
    patches."""

    patches: Any  # torch.Tensor
    grid: tuple[int, int, int]

    def to(self, device: Any) -> GridPatches:
        return GridPatches(self.patches.to(device), self.grid)


class Qwen2VLFamily(ImageFamily):
    """Qwen2-VL: an image is one run of `<|image_pad|>` tokens, `grid` its (t, h, w) after the
    merge (M-RoPE's positions, core/multimodal/positions.py). There are no tiles: `split` False
    (OpenAI's detail "low") caps the image at LOW_DETAIL_PIXELS (OpenAI's low-detail view is
    512 pixels a side), under the processor's own max_pixels."""

    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    LOW_DETAIL_PIXELS = 448 * 448  # at most 256 image tokens

    def __init__(self, processor: Any, image_token_id: int):
        super().__init__(processor)
        self.placeholder_id = image_token_id
        self.merge = int(processor.merge_size)

    @classmethod
    def load_processor(cls, directory: str) -> Any:
        """The checkpoint's image processor (the fast one where torchvision is installed, else PIL's)."""
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(directory, local_files_only=True)

    @classmethod
    def processor_from_config(cls, processor_config: dict[str, Any], tokenizer_files: tuple[str, str | None]) -> Any:
        """transformers' PIL Qwen2VLImageProcessor (the one AutoImageProcessor gives without
        torchvision; BICUBIC, as llama.cpp's clip.cpp), alone as load_processor's: the expansion
        needs no tokenizer (`tokenizer_files` is not read)."""
        try:  # transformers 5: the PIL image processor has its own class
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
                Qwen2VLImageProcessorPil as ImageProcessor
        except ImportError:  # transformers 4: Qwen2VLImageProcessor is the PIL one
            from transformers import Qwen2VLImageProcessor as ImageProcessor

        return ImageProcessor(**processor_config["image_processor"])

    def prepare(self, image: Any, split: bool) -> tuple[Any, Expansion]:
        frames = self.frames(image, split)
        t, h, w = frames.grid
        grid = (t, h // self.merge, w // self.merge)
        count = t * grid[1] * grid[2]
        return frames, Expansion((self.placeholder_id,) * count, tuple(range(count)), grid)

    def frames(self, image: Any, split: bool) -> GridPatches:
        options = {}
        if not split:
            size = self.processor.size
            options["size"] = {"shortest_edge": size["shortest_edge"],
                               "longest_edge": min(size["longest_edge"], self.LOW_DETAIL_PIXELS)}
        out = self.processor(images=[image], return_tensors="pt", **options)
        return GridPatches(out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0]))
