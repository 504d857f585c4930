"""What the gateway accepts as images: one frozen object from `switchyard serve`'s flags (flags.py)."""
from __future__ import annotations

from dataclasses import dataclass

# Pillow's names of the formats read (others, e.g. TIFF or EPS, are refused before decoding)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class MediaPolicy:
    # Hosts whose http(s) image URLs may be fetched, exactly as written (a host name or an IP
    # literal); empty: no URL is fetched, only data URLs and inline base64 are read.
    allowed_domains: tuple[str, ...] = ()
    # Whether a fetch may reach loopback, private, link-local or other non-global addresses
    # (127.0.0.0/8, 10/8, 192.168/16, 169.254/16, ::1, fc00::/7, ...). Off: such an address is
    # refused even for an allowed host (DNS may point an allowed name anywhere).
    allow_private_networks: bool = False
    limit_per_prompt: int = 8  # images one request may carry
    max_image_bytes: int = 20 << 20  # encoded, per image (a fetched body stops there)
    max_image_pixels: int = 50_000_000  # width x height, read from the header before decoding
    fetch_timeout_s: float = 10.0  # a whole fetch, redirects included
    max_redirects: int = 3  # each redirect's target is checked as the first URL was

    @property
    def fetches(self) -> bool:
        return bool(self.allowed_domains)
