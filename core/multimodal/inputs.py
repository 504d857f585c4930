"""An image on its way through the engine. Torch-free: the gateway builds `ImageData`, the engine
fills a request's `ImageSpan`s, the scheduler reads them (prefix-cache keys, which images a chunk
touches).

`ImageData.key` (the sha256 of the image's encoded bytes, hex, and how it is to be prepared: split
into tiles or not) names the image everywhere: it keys the memo of placeholder expansions and the
encoder cache, and it is mixed into the prefix-cache hash of every KV block an image's placeholder
tokens touch (as `ImageSpan.content_hash`), so two prompts with equal placeholder tokens but
different images never share KV blocks, and the same image does."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ImageData:
    """One image of a request, as the gateway validated it (Pillow read its header, checked its
    size): the encoded bytes, decoded again in the engine process. `split`: the image processor
    may cut it into tiles (the default; Idefics3's do_image_splitting); False: one downscaled view
    only, far fewer image tokens (the gateway's reading of OpenAI's detail "low")."""

    data: bytes
    content_hash: str
    width: int
    height: int
    format: str  # Pillow's name: "PNG", "JPEG", ...
    split: bool = True

    @classmethod
    def of(cls, data: bytes, width: int, height: int, format: str, split: bool = True) -> ImageData:
        return cls(data, hashlib.sha256(data).hexdigest(), width, height, format, split)

    @property
    def key(self) -> str:
        """The image as the engine prepares it: its content hash, marked when it is not split
        (the same bytes unsplit are other image tokens and other embeddings)."""
        return self.content_hash if self.split else f"{self.content_hash}/unsplit"


@dataclass(frozen=True)
class ImageSpan:
    """Where one image sits in a request's expanded prompt: positions [offset, offset + length)
    are its placeholder (the model's image tokens and the markers around them); the positions
    offset + r, r in `embed_offsets`, take the rows of its encoder output, in order.
    `content_hash` is its ImageData.key. `pixels` is the image processor's output for it, made
    when the encoder first needs it (core/multimodal/pixels.py `Pixels`; opaque here). `grid`:
    its Expansion's (core/multimodal/family.py), () for families whose positions are plain."""

    offset: int
    length: int
    content_hash: str
    embed_offsets: tuple[int, ...]
    pixels: Any = field(default=None, compare=False, repr=False)  # not what the span is, what it is made of
    grid: tuple[int, ...] = ()  # the family's layout of its rows, where positions depend on it (families.py)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeddings(self) -> int:
        return len(self.embed_offsets)

    @property
    def image_run(self) -> tuple[int, int]:
        """The first and last positions of its image tokens (one run where they attend to each other
        both ways: core/multimodal/image_rows.py)."""
        return self.offset + self.embed_offsets[0], self.offset + self.embed_offsets[-1]


def spans_in(spans: tuple[ImageSpan, ...], start: int, stop: int) -> tuple[ImageSpan, ...]:
    """The spans that overlap positions [start, stop)."""
    return tuple(s for s in spans if s.offset < stop and start < s.end)


def block_extra_key(spans: tuple[ImageSpan, ...], start: int, stop: int) -> bytes:
    """What the prefix-cache hash of the block of positions [start, stop) mixes in besides its
    tokens (core/kv/block_hash.py): the content hash of each image it overlaps, and where."""
    return b"".join(f"{s.content_hash}@{s.offset}".encode() + b"\x00" for s in spans_in(spans, start, stop))
