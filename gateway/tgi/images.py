"""TGI's images: markdown `![alt](url)` in `inputs` (TGI's own convention for vision models), the
url a data URL or an allowed http(s) URL. Each becomes the model's image placeholder (EngineInfo.
image_token) in the text and an ImageRef (gateway/media); for a text-only model `inputs` stays text."""
from __future__ import annotations

import re

from ..media import ImageRef, load_images

_MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


async def markdown_images(service, inputs: str) -> tuple[str, tuple]:
    """(inputs with each markdown image replaced by the image placeholder, the images loaded)."""
    info = service.client.info
    if info is None or info.image_token is None or "![" not in inputs:
        return inputs, ()
    refs = [ImageRef(f"inputs.images.{i}", url=m.group(1)) for i, m in enumerate(_MARKDOWN_IMAGE.finditer(inputs))]
    if not refs:
        return inputs, ()
    images = await load_images(refs, service.settings.media)
    return _MARKDOWN_IMAGE.sub(lambda _: info.image_token, inputs), images
