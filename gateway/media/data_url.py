"""`data:` URLs (RFC 2397) of images: `data:image/png;base64,...`."""
from __future__ import annotations

import base64
import binascii

from ..errors import invalid


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def data_url_bytes(url: str, param: str) -> bytes:
    """The decoded payload; a 400 naming `param` unless it is a base64 image data URL."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise invalid("the data URL has no ',' before its data", param)
    media_type, *options = header.split(";")
    if media_type and not media_type.lower().startswith("image/"):
        raise invalid(f"the data URL's media type is {media_type!r}, not an image", param)
    if "base64" not in (o.lower() for o in options):
        raise invalid("image data URLs must be base64 (data:image/png;base64,...)", param)
    return base64_bytes(payload, param)


def base64_bytes(payload: str, param: str) -> bytes:
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise invalid("the image's base64 data is not valid base64", param) from None
