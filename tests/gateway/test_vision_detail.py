"""OpenAI's image_url.detail reaches the engine as ImageData.split (core/multimodal/inputs.py):
"low" is an image not split into tiles, "auto", "high" and no detail leave the model's processor
to decide (split)."""
from __future__ import annotations

import asyncio
import base64

import pytest

from switchyard.core.testing.tiny_vlm import png_bytes
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.media import MediaPolicy, load_images
from switchyard.gateway.openai.images import image_refs
from switchyard.gateway.openai.schemas import ChatMessage

URL = "data:image/png;base64," + base64.b64encode(png_bytes(16, 12, 1)).decode()


def message(*details) -> ChatMessage:
    parts = [{"type": "image_url", "image_url": URL if d == "bare" else {"url": URL, **({"detail": d} if d else {})}}
             for d in details]
    return ChatMessage(role="user", content=parts + [{"type": "text", "text": "what?"}])


def test_detail_low_loads_an_unsplit_image():
    images = asyncio.run(load_images(image_refs([message("low", "high", "auto", None, "bare")]), MediaPolicy()))
    assert [i.split for i in images] == [False, True, True, True, True]
    assert len({i.content_hash for i in images}) == 1  # the same bytes ...
    assert images[0].key != images[1].key  # ... prepared otherwise by the engine


def test_an_unknown_detail_is_still_refused():
    with pytest.raises(GatewayError, match="image_url.detail"):
        image_refs([message("medium")])
