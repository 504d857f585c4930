"""`switchyard serve`'s flags of what images the gateway accepts (policy.py), read into MediaPolicy."""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

from .policy import MediaPolicy


def add_media_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    defaults = MediaPolicy()
    parser.add_argument("--allowed-media-domains", nargs="*", default=[],
                        help="hosts whose http(s) image URLs the server may fetch (exact host names or IP "
                        "literals); by default none: images come inline as data URLs or base64")
    parser.add_argument("--allow-private-media-urls", action="store_true",
                        help="let image fetches reach loopback, private and link-local addresses (refused by "
                        "default even for an allowed host)")
    parser.add_argument("--limit-mm-per-prompt", type=_image_limit, default=defaults.limit_per_prompt,
                        help="images one request may carry: a number, or vLLM's JSON form '{\"image\": N}' "
                        f"(default {defaults.limit_per_prompt})")
    parser.add_argument("--max-image-bytes", type=int, default=defaults.max_image_bytes,
                        help="largest encoded image, inline or fetched (bytes)")
    parser.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels,
                        help="largest image, width x height, checked before decoding")
    parser.add_argument("--media-fetch-timeout", type=float, default=defaults.fetch_timeout_s,
                        help="seconds one image fetch may take, redirects included")


def _image_limit(value: str) -> int:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a number or JSON: {value!r}") from None
    if isinstance(parsed, dict):
        parsed = parsed.get("image", MediaPolicy().limit_per_prompt)
    if not isinstance(parsed, int) or parsed < 0:
        raise argparse.ArgumentTypeError(f"the image limit must be a whole number >= 0, got {value!r}")
    return parsed


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    return MediaPolicy(allowed_domains=tuple(d.lower().rstrip(".") for d in args.allowed_media_domains),
                       allow_private_networks=args.allow_private_media_urls,
                       limit_per_prompt=args.limit_mm_per_prompt, max_image_bytes=args.max_image_bytes,
                       max_image_pixels=args.max_image_pixels, fetch_timeout_s=args.media_fetch_timeout)
