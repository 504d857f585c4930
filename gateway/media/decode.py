"""An image's bytes -> ImageData, or a 400 naming its part. Pillow reads the header first: the
format must be one of IMAGE_FORMATS and width x height within the policy (a decompression bomb is
refused before any pixel is decoded); then the whole image is decoded once, so a truncated or
corrupt file is refused here rather than in the engine."""
from __future__ import annotations

import io
import warnings

from switchyard.core.multimodal.inputs import ImageData

from ..errors import GatewayError, invalid
from .policy import IMAGE_FORMATS, MediaPolicy


def read_image(data: bytes, policy: MediaPolicy, param: str) -> ImageData:
    from PIL import Image

    if len(data) > policy.max_image_bytes:
        raise invalid(f"the image is {len(data)} bytes, more than the {policy.max_image_bytes} allowed", param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                fmt, (width, height) = image.format, image.size
                if fmt not in IMAGE_FORMATS:
                    raise invalid(f"image format {fmt} is not supported (supported: {', '.join(IMAGE_FORMATS)})",
                                  param)
                if width * height > policy.max_image_pixels:
                    raise invalid(f"the image is {width}x{height} pixels, more than the {policy.max_image_pixels} "
                                  "allowed", param)
                image.load()
    except GatewayError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise invalid(f"the image is too large to decode: {exc}", param) from None
    except Exception as exc:  # noqa: BLE001 - whatever Pillow raises, the image is unreadable
        raise invalid(f"the image could not be read ({type(exc).__name__}: {exc})", param) from None
    return ImageData.of(data, width, height, fmt)
