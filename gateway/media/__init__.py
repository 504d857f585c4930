"""Images a request carries, read and checked in the gateway (docs/vision.md).

Each dialect finds its own image parts (OpenAI's `image_url` and `input_image`, Anthropic's
`image` blocks, TGI's `![](...)` markdown) and names them as `ImageRef`s; `load_images` (loader.py)
turns them into `ImageData` (core/multimodal/inputs.py: the bytes and their content hash) for the
engine: data URLs decoded (data_url.py), http(s) URLs fetched only as `MediaPolicy` allows
(policy.py, fetch.py), each image's header and pixel count checked before it is decoded, then
decoded once to prove it whole (decode.py). Pillow only: no torch here."""
from .loader import ImageRef, load_images
from .policy import MediaPolicy

__all__ = ["ImageRef", "MediaPolicy", "load_images"]
