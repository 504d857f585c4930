"""The bytes each token stands for, built from a Hugging Face tokenizer (no hub access).

outlines-core matches regexes over bytes, so every ordinary token needs its exact byte
string: byte-level BPE tokens (GPT-2 style, "Ġ" for a space) map each character back
through the byte-to-unicode table; SentencePiece byte-fallback tokens ("<0x0A>") are one
byte; "▁" is a space in SentencePiece vocabularies. Special tokens are left out: they
are never part of constrained text (EOS is handled by the matcher).
"""
from __future__ import annotations

import re
from functools import lru_cache

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable characters stand for all 256 bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_values, chars = printable[:], printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(byte_values, chars)}


def is_byte_level(tokenizer) -> bool:
    """True for GPT-2 style byte-level BPE (the decoder maps characters back to bytes)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes(token: str, byte_level: bool) -> bytes | None:
    """The bytes of one vocabulary entry, or None if it cannot be mapped."""
    fallback = _BYTE_FALLBACK.match(token)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    if byte_level:
        table = unicode_to_bytes()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return token.encode("utf-8")  # an added token written in plain text
    return token.replace(_SPIECE_SPACE, " ").encode("utf-8")


def token_byte_map(tokenizer, vocab_size: int) -> dict[bytes, list[int]]:
    """{token bytes: [ids]} over the ordinary tokens below vocab_size."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special.update(i for i, t in added.items() if getattr(t, "special", False))
    byte_level = is_byte_level(tokenizer)
    mapping: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special or token_id >= vocab_size:
            continue
        data = token_bytes(token, byte_level)
        if data:
            mapping.setdefault(data, []).append(token_id)
    return mapping
