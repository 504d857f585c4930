"""How one model family prepares an image: its processor's call, the placeholder the prompt holds
for each image, and what that placeholder expands into. ImagePrompts (processor.py) runs a family;
the model class names its family (`image_family`, a key of FAMILIES), declared, not probed.

A family's `prepare` gives the image's frames (opaque here: what the model's `encode_images`
takes) and its `Expansion`; `frames` gives the frames again (an image whose expansion is
memoised, made lazily: pixels.py). Both take a PIL image and whether it may be split into tiles
(ImageData.split; a family without tiles ignores it)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Expansion:
    """One image's placeholder, expanded: its token ids; which of them take the encoder's rows,
    in order (offsets into `tokens`); `grid`: the family's layout of those rows where positions
    depend on it (Qwen2-VL's M-RoPE: (t, h, w) after merging), else ()."""

    tokens: tuple[int, ...]
    embed_offsets: tuple[int, ...]
    grid: tuple[int, ...] = ()


class ImageFamily(ABC):
    """One family's image preparation, over the model's transformers processor. `placeholder` is
    the text one image stands for in a rendered prompt (what the chat template writes, what the
    gateway writes for a TGI markdown image); `placeholder_id` its token id."""

    placeholder: str
    placeholder_id: int

    def __init__(self, processor: Any):
        self.processor = processor

    @abstractmethod
    def prepare(self, image: Any, split: bool) -> tuple[Any, Expansion]:
        """(the image's frames, its Expansion); raises on an image the processor cannot read."""

    @abstractmethod
    def frames(self, image: Any, split: bool) -> Any:
        """The frames `prepare` gave for this image (equal to them)."""


class Idefics3Family(ImageFamily):
    """Idefics3 and SmolVLM: the image is cut into tiles plus a global view (not with split
    False), each a run of `<image>` tokens between its markers (<fake_token_around_image>
    <row_i_col_j>); the frames are [F, 3, S, S]."""

    def __init__(self, processor: Any, image_token_id: int):
        super().__init__(processor)
        self.placeholder = processor.image_token
        self.placeholder_id = image_token_id

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


# ImageFamily classes by the name a model class gives as its `image_family`; each is built with
# (the model's transformers processor, the model's image_token_id).
FAMILIES: dict[str, type[ImageFamily]] = {"idefics3": Idefics3Family}


def family_for(model: Any, processor: Any) -> ImageFamily:
    """The model's family over its processor (`model.image_family`, a key of FAMILIES)."""
    return FAMILIES[model.image_family](processor, model.image_token_id)
