"""The block pool: which KV blocks are free, how many owners each one has, and
which full blocks are cached under the hash of their token chain.

Pure Python, no torch. Block 0 is reserved (block tables are padded with it) and
is never handed out. Free blocks wait in an LRU queue: `allocate` takes the
least recently freed block first, `free` puts a block at the most recent end.

Prefix caching: a full block carries the hash of its token chain (`cache_block`).
A freed block keeps its hash while it sits in the free queue; a cache hit revives
it with `incref` (which pulls it out of the queue), and `allocate` evicts from the
least recently used end, dropping the evicted block's hash. The free queue is an
ordered dict so that a revived block leaves it in O(1). One block per hash: a
second block computed with the same tokens stays unhashed (it is freed for reuse
like any other).

Partial hits: a cached block registered with its parent hash and its tokens is also
found by `partial_match`, for a request whose next tokens begin like the block's but
then differ (a chat prompt that shares the system prompt and not the user's words):
the request copies the matching slots into a block of its own (kv_cache_manager.py).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

RESERVED_BLOCK_ID = 0


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than the pool has free."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Keys are block ids, oldest first; the values are unused.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> the block holding those tokens
        # (parent hash, first token) -> {block: its tokens}, for partial hits; and each block's key
        self._children: dict[tuple[bytes, int], dict[int, tuple[int, ...]]] = {}
        self._child_keys: dict[int, tuple[bytes, int]] = {}

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (owned or free)."""
        return len(self._cached)

    @property
    def num_usable_blocks(self) -> int:
        """Every block except the reserved one."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks that are owned, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` blocks, each with one owner; all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            self.uncache(block_id)  # evicted: its old tokens are about to be overwritten
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def cache_block(self, block_id: int, block_hash: bytes, parent: bytes | None = None,
                    tokens: tuple[int, ...] = ()) -> bool:
        """Make an owned, full block findable under `block_hash`, and with `parent` (the hash
        its chain continues) and its `tokens` by partial_match too; False (nothing changes)
        if another block already holds that hash or this one holds another."""
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only owned blocks are cached")
        if block_hash in self._cached or self.block_hashes[block_id] is not None:
            return False
        self._cached[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        if parent is not None and tokens:
            key = (parent, tokens[0])
            self._children.setdefault(key, {})[block_id] = tokens
            self._child_keys[block_id] = key
        return True

    def partial_match(self, parent: bytes, tokens, excluded=frozenset()) -> tuple[int, int] | None:
        """The cached block after `parent` whose tokens begin with the longest run of `tokens`
        (at least one, fewer than all of them: a whole match is a full hit), and that run's
        length; None when no block begins with tokens[0]. `excluded`: blocks not to use."""
        best = None
        for block_id, cached in self._children.get((parent, tokens[0]), {}).items():
            if block_id in excluded:
                continue
            length = next((i for i, (a, b) in enumerate(zip(cached, tokens)) if a != b), min(len(cached), len(tokens)))
            if 0 < length < len(cached) and (best is None or length > best[1]):
                best = (block_id, length)
        return best

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the tokens of `block_hash`, owned or free, if any."""
        return self._cached.get(block_hash)

    def uncache(self, block_id: int) -> None:
        """Forget the block's hash (no-op if it has none)."""
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hashes[block_id] = None
            key = self._child_keys.pop(block_id, None)
            if key is not None:
                siblings = self._children[key]
                del siblings[block_id]
                if not siblings:
                    del self._children[key]

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one owner to each block; a free block leaves the free queue."""
        for block_id in block_ids:
            self._check_block_id(block_id)
            if self.ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner of each block; a block with no owner left becomes free.

        Pass a request's blocks in reverse order so that its tail blocks are the
        first to be reused (they are the least likely prefix-cache hits).
        """
        for block_id in block_ids:
            self._check_block_id(block_id)
            if self.ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is already free")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free_queue[block_id] = None

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_queue

    def _check_block_id(self, block_id: int) -> None:
        if block_id == RESERVED_BLOCK_ID:
            raise ValueError("block 0 is reserved")
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block {block_id} is out of range [1, {self.num_blocks})")
