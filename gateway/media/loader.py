"""A request's images, loaded: each `ImageRef` (a data URL, an http(s) URL, or inline base64
bytes) read into `ImageData`, fetched concurrently and decoded off the event loop; the request's
first bad image is a 400 naming its part, and too many images (--limit-mm-per-prompt) a 400
naming the first one past the limit."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from switchyard.core.multimodal.inputs import ImageData

from ..errors import invalid
from .data_url import base64_bytes, data_url_bytes, is_data_url
from .decode import read_image
from .fetch import fetch_image
from .policy import MediaPolicy


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: `url` (data: or http(s)), or `base64` data; `param` names the
    part in the request (`messages.1.content.0`), for errors. `split`: ImageData.split (False
    where the dialect asked for a low-detail image)."""

    param: str
    url: str | None = None
    base64: str | None = None
    split: bool = True


def check_count(refs: list[ImageRef], policy: MediaPolicy) -> None:
    if len(refs) > policy.limit_per_prompt:
        raise invalid(f"the request has {len(refs)} images; at most {policy.limit_per_prompt} are allowed "
                      "(--limit-mm-per-prompt)", refs[policy.limit_per_prompt].param)


async def load_images(refs: list[ImageRef], policy: MediaPolicy) -> tuple[ImageData, ...]:
    check_count(refs, policy)
    return tuple(await asyncio.gather(*(_load(ref, policy) for ref in refs)))


async def _load(ref: ImageRef, policy: MediaPolicy) -> ImageData:
    if ref.base64 is None and ref.url is not None and not is_data_url(ref.url):
        data = await fetch_image(ref.url, policy, ref.param)
        image = await asyncio.to_thread(read_image, data, policy, ref.param)
    else:
        image = await asyncio.to_thread(_read_inline, ref, policy)
    return image if ref.split else replace(image, split=False)


def _read_inline(ref: ImageRef, policy: MediaPolicy) -> ImageData:
    if ref.base64 is not None:
        data = base64_bytes(ref.base64, ref.param)
    elif ref.url:
        data = data_url_bytes(ref.url, ref.param)
    else:
        raise invalid("the image has no url or data", ref.param)
    return read_image(data, policy, ref.param)
