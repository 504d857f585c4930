"""Maps requests to KV blocks: how many a request needs, allocating and freeing them.

Pure Python, no torch. A request that has computed `c` tokens and computes `n`
more this step holds ceil((c + n) / block_size) blocks in `request.block_ids`.

Room for prefix caching (not built yet): a `get_computed_blocks(request)` step
before the first allocation will look the prompt's full blocks up by hash, share
the hits with `BlockPool.incref` and advance `num_computed_tokens` past them.
"""
from __future__ import annotations

from ..request import Request
from .block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_pool = block_pool
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one request could hold with every usable block."""
        return self.block_pool.num_usable_blocks * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so the request can hold `num_new_tokens` more tokens."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow `request.block_ids` to hold `num_new_tokens` more tokens.

        All or nothing: returns False, changing nothing, when too few blocks are free.
        """
        num_blocks = self.num_blocks_needed(request, num_new_tokens)
        if num_blocks > self.block_pool.num_free_blocks:
            return False
        request.block_ids.extend(self.block_pool.allocate(num_blocks))
        return True

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool, tail first, and clear its block ids."""
        self.block_pool.free(reversed(request.block_ids))
        request.block_ids.clear()

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit in the pool when nothing else holds a block."""
        return cdiv(num_tokens, self.block_size) <= self.block_pool.num_usable_blocks
