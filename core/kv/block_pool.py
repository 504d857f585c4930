"""The block pool: which KV blocks are free, and how many owners each one has.

Pure Python, no torch. Block 0 is reserved (block tables are padded with it) and
is never handed out. Free blocks wait in an LRU queue: `allocate` takes the
least recently freed block first, `free` puts a block at the most recent end.

Room for prefix caching (not built yet): a full block will carry the hash of its
token chain. A freed block keeps its hash while it sits in the free queue; a cache
hit revives it with `incref` (which pulls it out of the queue), and `allocate`
evicts from the least recently used end, dropping the evicted block's hash. The
free queue is an ordered dict so that a revived block leaves it in O(1).
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
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

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
