"""The engine's side of a request's images: the model's own image processor (transformers', the
fast one where it can run; for a GGUF pair, made from its mmproj file's metadata) turns each
image into its frames, and its placeholder token in the prompt into the model's expansion
(Idefics3: a <fake_token_around_image><row_i_col_j> tile run of <image> tokens per tile, then the
global view), tokenized with the model's tokenizer.

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
from .inputs import ImageData, ImageSpan
from .pixels import Pixels

logger = logging.getLogger(__name__)


def decode_image(image: ImageData) -> Any:
    """The image as an RGB PIL image (the gateway checked its header and size already)."""
    from PIL import Image

    with Image.open(io.BytesIO(image.data)) as opened:
        return opened.convert("RGB")


def load_hf_processor(directory: str) -> Any:
    """transformers' processor saved with the model. Its image processor is the fast (torchvision)
    one where torchvision is installed, else transformers falls back to the PIL one (one warning).
    Nothing is downloaded."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(directory, local_files_only=True)


def processor_from_config(processor_config: dict[str, Any], tokenizer_files: tuple[str, str | None]) -> Any:
    """transformers' Idefics3 processor for a model with no processor files (a GGUF pair): made as
    a checkpoint's processor_config.json makes it (`processor_config`, laid out as that file, is
    decided from the mmproj file's metadata: core/loader/mmproj.py), over the language model's own
    tokenizer (`tokenizer_files`: ModelSource.tokenizer_files). Its image processor is the PIL one,
    the one transformers' AutoImageProcessor gives Idefics3 (LANCZOS resizing, as llama.cpp's)."""
    from transformers import AutoTokenizer, Idefics3Processor

    try:  # transformers 5: the PIL image processor has its own class
        from transformers.models.idefics3.image_processing_pil_idefics3 import \
            Idefics3ImageProcessorPil as ImageProcessor
    except ImportError:  # transformers 4: Idefics3ImageProcessor is the PIL one
        from transformers import Idefics3ImageProcessor as ImageProcessor

    directory, gguf_file = tokenizer_files
    tokenizer = AutoTokenizer.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))
    return Idefics3Processor(ImageProcessor(**processor_config["image_processor"]), tokenizer,
                             image_seq_len=processor_config["image_seq_len"])


class ExpansionMemo:
    """The token ids of an image's placeholder expansion by ImageData.key, least recently used
    out first: the expansion depends only on the image and the processor, and it is all that
    add_request needs of an image (no pixels here)."""

    def __init__(self, max_entries: int = 256):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def get(self, key: str) -> tuple[int, ...] | None:
        tokens = self._entries.get(key)
        if tokens is not None:
            self._entries.move_to_end(key)
        return tokens

    def put(self, key: str, tokens: tuple[int, ...]) -> None:
        self._entries[key] = tokens
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class ImagePrompts:
    """Expands a request's image placeholders, and gives each image its pixels (`Pixels`).

    An image seen before (its expansion in the memo) is not decoded nor processed here: its
    pixels are made when the encoder first needs them (core/multimodal/pixels.py), which a
    prefix-cache or encoder-cache hit spares. A new image is processed at once, which both proves
    it readable (a ValidationError, the request's 400, not a failed step) and gives its expansion;
    its frames stay on its span."""

    def __init__(self, hf_processor: Any, image_token_id: int, memo_size: int = 256):
        self.processor = hf_processor
        self.image_token_id = image_token_id
        self.image_token: str = hf_processor.image_token  # the placeholder text, one per image
        self.expansions = ExpansionMemo(memo_size)

    @classmethod
    def for_model(cls, model: Any, directory: str | None) -> ImagePrompts | None:
        """None for a text-only model."""
        if not hasattr(model, "encode_images") or directory is None:
            return None
        return cls(load_hf_processor(directory), model.image_token_id)

    def prepare(self, request: Any) -> None:
        """Replace each image placeholder of `request.prompt_token_ids` by its expansion and record
        where each image sits (`request.image_spans`); raises ValidationError if the placeholders
        and the images do not pair up or an image cannot be read."""
        ids = request.prompt_token_ids
        places = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(places) != len(request.images):
            raise ValidationError(f"the prompt has {len(places)} image placeholders ({self.image_token}) for "
                                  f"{len(request.images)} images", "images")
        expanded: list[int] = []
        spans: list[ImageSpan] = []
        previous = 0
        for index, (place, image) in enumerate(zip(places, request.images)):
            expanded.extend(ids[previous:place])
            tokens, pixels = self._prepared(image, index)
            offsets = tuple(i for i, token in enumerate(tokens) if token == self.image_token_id)
            spans.append(ImageSpan(len(expanded), len(tokens), image.key, offsets, pixels))
            expanded.extend(tokens)
            previous = place + 1
        expanded.extend(ids[previous:])
        request.prompt_token_ids = expanded
        request.image_spans = tuple(spans)
        request.images = ()  # the pixels are on the spans now

    def _prepared(self, image: ImageData, index: int) -> tuple[tuple[int, ...], Pixels]:
        """(its expansion's token ids, its pixels): from the memo, the pixels made later; else
        processed now."""
        tokens = self.expansions.get(image.key)
        if tokens is not None:
            return tokens, Pixels.later(partial(self.frames, image))
        frames, expansion = self._expand(image, index)
        tokens = tuple(expansion)
        self.expansions.put(image.key, tokens)
        return tokens, Pixels.ready(frames)

    def _expand(self, image: ImageData, index: int) -> tuple[Any, list[int]]:
        """(the image's frames [F, 3, S, S], the token ids of its placeholder's expansion)."""
        try:
            out = self._process(image)
        except Exception as exc:  # noqa: BLE001 - a failure on one image is that request's, not the engine's
            raise ValidationError(f"image {index} could not be prepared: {exc}", "images") from None
        text = self.processor.replace_image_token({"rows": out["rows"], "cols": out["cols"]}, 0)
        tokens = self.processor.tokenizer.encode(text, add_special_tokens=False)
        return out["pixel_values"][0], tokens

    def frames(self, image: ImageData) -> Any:
        """The image's frames [F, 3, S, S] (an image whose expansion is memoised: read before)."""
        return self._process(image)["pixel_values"][0]

    def _process(self, image: ImageData) -> Any:
        """The image processor's output for one image (tiled, or with `split` False one view)."""
        options = {} if image.split else {"do_image_splitting": False}
        return self.processor.image_processor(images=[[decode_image(image)]], return_row_col_info=True,
                                              return_tensors="pt", **options)


def image_prompts_for(loaded: Any, backend: Any) -> ImagePrompts | None:
    """The engine's ImagePrompts for a loaded model, or None where it reads text only: a text
    model, or a vision-language model on a backend that does not declare it runs vision towers
    (Capabilities.vision_encoders; one logged line)."""
    if not hasattr(loaded.model, "encode_images"):
        return None
    if not backend.capabilities().vision_encoders:
        logger.warning("backend %s does not run vision encoders: this model serves text only, and a request "
                       "with images is refused", backend.name)
        return None
    processor_config = getattr(loaded.hf_config, "processor_config", None)  # a GGUF pair's (no processor files)
    if processor_config is not None:
        return ImagePrompts(processor_from_config(processor_config, loaded.source.tokenizer_files),
                            loaded.model.image_token_id)
    return ImagePrompts.for_model(loaded.model, loaded.source.directory)


def prepare_images(prompts: ImagePrompts | None, request: Any) -> None:
    """At add_request: a request with images is expanded (ImagePrompts.prepare), or refused where
    the engine reads text only."""
    if not request.images:
        return
    if prompts is None:
        raise ValidationError("this model reads text only: images are not supported", "images")
    prompts.prepare(request)
