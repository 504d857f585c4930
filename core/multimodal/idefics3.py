"""Idefics3's image family (SmolVLM's too): transformers' Idefics3 processor cuts an image into tiles
of the tower's image size plus a downscaled global view (one view with split False), and expands
its `<image>` placeholder into a run of image tokens per view between the view's markers."""
from __future__ import annotations

from typing import Any

from .family import Expansion, ImageFamily, load_pair_tokenizer


class Idefics3Family(ImageFamily):
    """Idefics3 and SmolVLM: the image is cut into tiles plus a global view (not with split
    False), each a run of `<image>` tokens between its markers (<fake_token_around_image>
    <row_i_col_j>); the frames are [F, 3, S, S]."""

    def __init__(self, processor: Any, image_token_id: int):
        super().__init__(processor)
        self.placeholder = processor.image_token
        self.placeholder_id = image_token_id

    @classmethod
    def processor_from_config(cls, processor_config: dict[str, Any], tokenizer_files: tuple[str, str | None]) -> Any:
        """transformers' Idefics3 processor with the PIL image processor, the one its
        AutoImageProcessor gives (LANCZOS resizing, as llama.cpp's)."""
        from transformers import Idefics3Processor

        try:  # transformers 5: the PIL image processor has its own class
            from transformers.models.idefics3.image_processing_pil_idefics3 import \
                Idefics3ImageProcessorPil as ImageProcessor
        except ImportError:  # transformers 4: Idefics3ImageProcessor is the PIL one
            from transformers import Idefics3ImageProcessor as ImageProcessor

        return Idefics3Processor(ImageProcessor(**processor_config["image_processor"]),
                                 load_pair_tokenizer(tokenizer_files), image_seq_len=processor_config["image_seq_len"])

    def prepare(self, image: Any, split: bool) -> tuple[Any, Expansion]:
        out = self._process(image, split)
        text = self.processor.replace_image_token({"rows": out["rows"], "cols": out["cols"]}, 0)
        tokens = tuple(self.processor.tokenizer.encode(text, add_special_tokens=False))
        offsets = tuple(i for i, token in enumerate(tokens) if token == self.placeholder_id)
        return out["pixel_values"][0], Expansion(tokens, offsets)

    def frames(self, image: Any, split: bool) -> Any:
        return self._process(image, split)["pixel_values"][0]

    def _process(self, image: Any, split: bool) -> Any:
        options = {} if split else {"do_image_splitting": False}
        return self.processor.image_processor(images=[[image]], return_row_col_info=True,
                                              return_tensors="pt", **options)
