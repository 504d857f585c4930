"""The image families a model class may name (`image_family`, a key of FAMILIES), declared, not
probed: how each prepares an image (its processor's call, the placeholder the prompt holds for each
image, what that placeholder expands into). ImagePrompts (processor.py) runs one; the base classes
are in family.py, each family in its own module."""
from __future__ import annotations

from typing import Any

from .family import ImageFamily
from .gemma3 import Gemma3Family
from .idefics3 import Idefics3Family
from .qwen2_vl import Qwen2VLFamily

# ImageFamily classes by the name a model class gives as its `image_family`; each is built with
# (the model's transformers processor, the model's image_token_id).
FAMILIES: dict[str, type[ImageFamily]] = {"idefics3": Idefics3Family, "qwen2_vl": Qwen2VLFamily,
                                        "gemma3": Gemma3Family}


def family_for(model: Any, processor: Any) -> ImageFamily:
    """The model's family over its processor (`model.image_family`, a key of FAMILIES)."""
    return FAMILIES[model.image_family](processor, model.image_token_id)
