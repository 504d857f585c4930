"""The engine's side of a request's images: the model's own image processor (transformers', the
fast one where it can run; for a GGUF pair, made from its mmproj file's metadata) turns each
image into its frames, and its placeholder token in the prompt into the model's expansion
(Idefics3: a <fake_token_around_image><row_i_col_j> tile run of <image> tokens per tile, then the
global view), tokenized with the model's tokenizer. A GGUF pair's processor is its family's
(`ImageFamily.processor_from_config`).

It runs in the engine process at add_request, before the scheduler sees the request, so the
scheduler, the KV cache and the prefix cache see the expanded prompt and its `ImageSpan`s. An
image whose expansion is known already (by ImageData.key) is not processed there: its pixels are
made only if the vision tower has to run on it (pixels.py)."""
from __future__ import annotations

import io
import logging
from collections import OrderedDict
from functools import partial
from typing import Any

from ..params import ValidationError
from .families import FAMILIES, family_for
from .family import Expansion, ImageFamily
from .inputs import ImageData, ImageSpan
from .pixels import Pixels

logger = logging.getLogger(__name__)


def decode_image(image: ImageData) -> Any:
    """The image as an RGB PIL image (the gateway checked its header and size already)."""
    from PIL import Image

    with Image.open(io.BytesIO(image.data)) as opened:
        return opened.convert("RGB")


class ExpansionMemo:
    """An image's placeholder `Expansion` by ImageData.key, least recently used out first: the
    expansion depends only on the image and the processor, and it is all that add_request needs of
    an image (no pixels here)."""

    def __init__(self, max_entries: int = 256):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Expansion] = OrderedDict()

    def get(self, key: str) -> Expansion | None:
        expansion = self._entries.get(key)
        if expansion is not None:
            self._entries.move_to_end(key)
        return expansion

    def put(self, key: str, expansion: Expansion) -> None:
        self._entries[key] = expansion
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class ImagePrompts:
    """Expands a request's image placeholders, and gives each image its pixels (`Pixels`), as the
    model's family does it (families.py).

    An image seen before (its expansion in the memo) is not decoded nor processed here: its
    pixels are made when the encoder first needs them (core/multimodal/pixels.py), which a
    prefix-cache or encoder-cache hit spares. A new image is processed at once, which both proves
    it readable (a ValidationError, the request's 400, not a failed step) and gives its expansion;
    its frames stay on its span."""

    def __init__(self, family: ImageFamily, memo_size: int = 256):
        self.family = family
        self.image_token: str = family.placeholder  # the placeholder text, one per image
        self.expansions = ExpansionMemo(memo_size)

    @property
    def processor(self) -> Any:
        return self.family.processor

    def prepare(self, request: Any) -> None:
        """Replace each image placeholder of `request.prompt_token_ids` by its expansion and record
        where each image sits (`request.image_spans`); raises ValidationError if the placeholders
        and the images do not pair up or an image cannot be read."""
        ids = request.prompt_token_ids
        places = [i for i, token in enumerate(ids) if token == self.family.placeholder_id]
        if len(places) != len(request.images):
            raise ValidationError(f"the prompt has {len(places)} image placeholders ({self.image_token}) for "
                                  f"{len(request.images)} images", "images")
        expanded: list[int] = []
        spans: list[ImageSpan] = []
        previous = 0
        for index, (place, image) in enumerate(zip(places, request.images)):
            expanded.extend(ids[previous:place])
            expansion, pixels = self._prepared(image, index)
            spans.append(ImageSpan(len(expanded), len(expansion.tokens), image.key, expansion.embed_offsets,
                                   pixels, expansion.grid))
            expanded.extend(expansion.tokens)
            previous = place + 1
        expanded.extend(ids[previous:])
        expanded, spans = self.family.joined(expanded, spans)  # edges merged as the processor tokenizes
        request.prompt_token_ids = expanded
        request.image_spans = tuple(spans)
        request.images = ()  # the pixels are on the spans now

    def _prepared(self, image: ImageData, index: int) -> tuple[Expansion, Pixels]:
        """(its expansion, its pixels): from the memo, the pixels made later; else processed now."""
        expansion = self.expansions.get(image.key)
        if expansion is not None:
            return expansion, Pixels.later(partial(self.frames, image))
        try:
            frames, expansion = self.family.prepare(decode_image(image), image.split)
        except Exception as exc:  # noqa: BLE001 - a failure on one image is that request's, not the engine's
            raise ValidationError(f"image {index} could not be prepared: {exc}", "images") from None
        self.expansions.put(image.key, expansion)
        return expansion, Pixels.ready(frames)

    def frames(self, image: ImageData) -> Any:
        """The image's frames (an image whose expansion is memoised: read before)."""
        return self.family.frames(decode_image(image), image.split)


def image_prompts_for(loaded: Any, backend: Any) -> ImagePrompts | None:
    """The engine's ImagePrompts for a loaded model, or None where it reads text only: a text
    model, or a vision-language model on a backend that does not declare it runs vision towers
    (Capabilities.vision_encoders; one logged line)."""
    if loaded.model.image_family is None:
        return None
    if not backend.capabilities().vision_encoders:
        logger.warning("backend %s does not run vision encoders: this model serves text only, and a request "
                       "with images is refused", backend.name)
        return None
    family = FAMILIES[loaded.model.image_family]
    processor_config = getattr(loaded.hf_config, "processor_config", None)  # a GGUF pair's (no processor files)
    if processor_config is not None:
        processor = family.processor_from_config(processor_config, loaded.source.tokenizer_files)
    elif loaded.source.directory is not None:
        processor = family.load_processor(loaded.source.directory)
    else:
        return None
    return ImagePrompts(family_for(loaded.model, processor))


def prepare_images(prompts: ImagePrompts | None, request: Any) -> None:
    """At add_request: a request with images is expanded (ImagePrompts.prepare), or refused where
    the engine reads text only."""
    if not request.images:
        return
    if prompts is None:
        raise ValidationError("this model reads text only: images are not supported", "images")
    prompts.prepare(request)
