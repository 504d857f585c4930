"""An image on its way through the engine. Torch-free: the gateway builds `ImageData`, the engine
fills a request's `ImageSpan`s, the scheduler reads them (prefix-cache keys, which images a chunk
touches).

`content_hash` (sha256 of the image's encoded bytes, hex) names the image everywhere: it keys
the encoder cache, and it is mixed into the prefix-cache hash of every KV block an image's
placeholder tokens touch, so two prompts with equal placeholder tokens but different images
never share KV blocks, and the same image does."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageData:
    """One image of a request, as the gateway validated it (Pillow read its header, checked its
    size): the encoded bytes, decoded again in the engine process."""

    data: bytes
    content_hash: str
    width: int
    height: int
    format: str  # Pillow's name: "PNG", "JPEG", ...

    @classmethod
    def of(cls, data: bytes, width: int, height: int, format: str) -> ImageData:
        return cls(data, hashlib.sha256(data).hexdigest(), width, height, format)


@dataclass(frozen=True)
class ImageSpan:
    """Where one image sits in a request's expanded prompt: positions [offset, offset + length)
    are its placeholder (the model's image tokens and the markers around them); the positions
    offset + r, r in `embed_offsets`, take the rows of its encoder output, in order. `pixels` is
    the image processor's output for it (the engine's, opaque here)."""

    offset: int
    length: int
    content_hash: str
    embed_offsets: tuple[int, ...]
    pixels: Any = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeddings(self) -> int:
        return len(self.embed_offsets)


def spans_in(spans: tuple[ImageSpan, ...], start: int, stop: int) -> tuple[ImageSpan, ...]:
    """The spans that overlap positions [start, stop)."""
    return tuple(s for s in spans if s.offset < stop and start < s.end)


def block_extra_key(spans: tuple[ImageSpan, ...], start: int, stop: int) -> bytes:
    """What the prefix-cache hash of the block of positions [start, stop) mixes in besides its
    tokens (core/kv/block_hash.py): the content hash of each image it overlaps, and where."""
    return b"".join(f"{s.content_hash}@{s.offset}".encode() + b"\x00" for s in spans_in(spans, start, stop))
