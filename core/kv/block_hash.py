"""Hash chains over full KV blocks (pure Python, no torch).

The hash of block i is sha256(hash of block i - 1 || token ids of block i as int32
bytes); block 0 chains from a root derived from the salt. Equal hashes therefore
mean an equal salt and equal tokens at every position up to the end of the block,
which is exactly when two requests may share the block's keys and values.

sha256 (OpenSSL) rather than Python's hash(): 256 bits leave no practical chance
of two different prefixes colliding (a collision would silently serve another
prompt's KV). It costs about 0.7 us per 16-token block on this CPU (~45 ns per
prompt token, ~90 us for a 2048-token prompt), paid once per request: the hashes
stay on the request (`Request.block_hashes`) across steps and preemptions.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes


def root_hash(salt: str | None) -> BlockHash:
    """The 'previous hash' of block 0: different salts never share a block."""
    return hashlib.sha256(b"switchyard-kv\x00" + (salt or "").encode()).digest()


def hash_block(parent: BlockHash, token_ids, extra: bytes = b"") -> BlockHash:
    """`extra`: what else decides the block's keys and values besides its tokens (the content
    hashes of the images its placeholder tokens stand for, core/multimodal/inputs.py)."""
    return hashlib.sha256(parent + array("i", token_ids).tobytes() + extra).digest()


def extend_block_hashes(block_hashes: list[BlockHash], token_slice: Callable[[int, int], Sequence[int]],
                        num_tokens: int, block_size: int, salt: str | None,
                        extra_key: Callable[[int, int], bytes] | None = None) -> None:
    """Append the hashes of the full blocks among the first `num_tokens` tokens that
    `block_hashes` does not cover yet; `token_slice(start, stop)` reads the tokens, and
    `extra_key(start, stop)`, if given, what else the block of those positions depends on."""
    parent = block_hashes[-1] if block_hashes else root_hash(salt)
    for index in range(len(block_hashes), num_tokens // block_size):
        start, stop = index * block_size, (index + 1) * block_size
        parent = hash_block(parent, token_slice(start, stop), extra_key(start, stop) if extra_key else b"")
        block_hashes.append(parent)
