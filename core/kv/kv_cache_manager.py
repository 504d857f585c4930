"""Maps requests to KV blocks: prefix-cache lookups, allocating and freeing blocks.

Pure Python, no torch. A request that has computed `c` tokens and computes `n`
more this step holds ceil((c + n) / block_size) blocks in `request.block_ids`.

Prefix caching. Every full block of a request (prompt and generated tokens) is
hashed in a chain (block_hash.py). When a step allocates blocks for tokens that
fill a block, the block is registered under its hash at once, so a request with
the same prefix admitted later in the same step shares it: every backend writes
the whole step's keys and values (`write_kv`) before any attention read in each
layer (core/layers/attention.py), so the shared block is complete when it is read.
A waiting request first takes the longest run of cached full blocks
(`get_computed_blocks`) and starts computing after them; at most num_tokens - 1
tokens come from the cache, block-aligned, so the last token is always computed
(its logits are needed) and nobody ever writes into a shared block.

Partial hits (`partial_hit`): after its full blocks, a request whose next tokens begin
like a cached block's (the same parent chain), but then differ, copies the matching
slots' keys and values into the first block it allocates, instead of computing them: a
chat prompt that shares a 24-token system prompt with a cached one computes from token
24, not 16. The copy (`KVCopy`) goes down with the step (SchedulerOutput.kv_copies) and
each shard applies it before the step's forward writes anything. The source must hold
its keys and values already: a block registered in this step (unconfirmed) is never a
source. The copied values are those the request would compute: a row's keys and values
depend on its tokens and the prefix only (on the CPU's block kernels to the bit, the
batch-invariance tests check it), so greedy tokens and log-probabilities are those of a
cold prompt. Requests with images look no partial hit up (a block's key then depends on
more than its tokens).

Pooling requests (core/pooling) hash no block: they neither look up nor share.

With prefix caching off, only requests of one share group (the n / best_of
sequences of a prompt) hash their blocks, salted with the group, and a block's
hash is dropped as soon as no request holds it: siblings share live blocks and
nothing is kept after they end.

A step whose scheduler output never reaches `Scheduler.update()` (the model step
failed) may have registered blocks whose keys and values were never written;
`discard_unconfirmed()` forgets those hashes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..scheduling.request import Request
from .block_hash import extend_block_hashes, root_hash
from .block_pool import BlockPool


@dataclass(frozen=True)
class KVCopy:
    """Copy the keys and values of the first `num_slots` slots of block `source` into block
    `target` (every layer), before the step computes anything."""
    source: int
    target: int
    num_slots: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, enable_prefix_caching: bool = True,
                 partial_hits: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.partial_hits = partial_hits  # partial_hit looks up (Capabilities.partial_prefix_hits)
        self._unconfirmed: list[tuple[int, bytes]] = []  # (block, hash) cached since the last confirm()
        self._copies: list[KVCopy] = []  # partial hits' copies since the last take_copies()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one request could hold with every usable block."""
        return self.block_pool.num_usable_blocks * self.block_size

    def hashes_blocks(self, request: Request) -> bool:
        """Whether the request's full blocks are hashed (looked up and shared). A pooling
        request's never are: it reads the hidden state of positions a cached block would skip
        (mean, CLS pooling), an encoder writes no keys and values, and its blocks are freed
        in the step that pools it."""
        if request.pooling is not None:
            return False
        return self.enable_prefix_caching or request.share_group is not None

    def _salt(self, request: Request) -> str | None:
        if self.enable_prefix_caching:
            return request.cache_salt
        return f"{request.cache_salt or ''}\x00group\x00{request.share_group}"

    def looks_up(self, request: Request) -> bool:
        """Whether admitting the request looks its blocks up in the cache."""
        return self.hashes_blocks(request) and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks a request without blocks can start from: the longest run of
        its full blocks found by hash, covering at most num_tokens - 1 tokens. Nothing is
        claimed yet (pass the list to `allocate_slots`). Requests that score prompt
        log-probabilities skip the lookup: cached positions produce no logits."""
        if not self.looks_up(request):
            return []
        assert not request.block_ids and request.num_computed_tokens == 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks * self.block_size)
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.block_pool.cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def partial_hit(self, request: Request, computed_blocks: list[int]) -> tuple[int, int] | None:
        """After `computed_blocks` (get_computed_blocks), a cached block whose first slots hold
        the request's next tokens, and how many (so that at most num_tokens - 1 tokens come
        from the cache); None when there is none (see the module docstring)."""
        if not (self.partial_hits and self.enable_prefix_caching and self.looks_up(request)) or request.image_spans:
            return None
        start = len(computed_blocks) * self.block_size
        stop = min(start + self.block_size, request.num_tokens - 1)
        if stop <= start:
            return None
        parent = self._parent_hash(request, len(computed_blocks))
        unconfirmed = {block_id for block_id, _ in self._unconfirmed}
        return self.block_pool.partial_match(parent, request.token_slice(start, stop), unconfirmed)

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_computed_blocks: int = 0,
                          num_copied: int = 0) -> int:
        """Blocks to add so the request can hold `num_new_tokens` more tokens after
        `num_computed_blocks` cached blocks (and `num_copied` tokens of a partial hit)."""
        num_tokens = request.num_computed_tokens + num_computed_blocks * self.block_size + num_copied + num_new_tokens
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_ids) - num_computed_blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = (),
                       num_lookahead: int = 0, partial: tuple[int, int] | None = None) -> bool:
        """Claim `computed_blocks` (from get_computed_blocks) and grow `request.block_ids`
        to hold `num_new_tokens` more tokens after them; register the blocks those tokens
        fill. All or nothing: returns False, changing nothing, when too few blocks are free.
        The caller advances num_computed_tokens past the computed blocks (and `partial`'s tokens).

        `partial` (from partial_hit: a block and a slot count): those slots are copied into the
        first block allocated now (take_copies), and the new tokens follow them.

        `num_lookahead` more slots are allocated after them for speculative tokens, which are
        not the request's tokens yet: the blocks they fill are registered only once accepted
        (`settle_speculation`)."""
        pool, block_size = self.block_pool, self.block_size
        num_copied = partial[1] if partial else 0
        num_blocks = self.num_blocks_needed(request, num_new_tokens + num_lookahead, len(computed_blocks), num_copied)
        num_revived = sum(1 for block_id in computed_blocks if pool.ref_counts[block_id] == 0)
        if num_blocks + num_revived > pool.num_free_blocks:
            return False
        num_computed = request.num_computed_tokens + len(computed_blocks) * block_size + num_copied
        if computed_blocks:
            pool.incref(computed_blocks)
            request.block_ids.extend(computed_blocks)
        if num_blocks:
            allocated = pool.allocate(num_blocks)
            if partial:  # copied before anything of the step is written, so the source may be evicted now
                self._copies.append(KVCopy(partial[0], allocated[0], num_copied))
            request.block_ids.extend(allocated)
        num_tokens = num_computed + num_new_tokens
        if num_tokens // block_size > num_computed // block_size and self.hashes_blocks(request):
            self._cache_full_blocks(request, num_computed, num_tokens)
        return True

    def _cache_full_blocks(self, request: Request, num_computed: int, num_tokens: int,
                           confirmed: bool = False) -> None:
        """Register the blocks that tokens [num_computed, num_tokens) complete."""
        self._extend_hashes(request, num_tokens)
        size = self.block_size
        for index in range(num_computed // size, num_tokens // size):
            block_id, block_hash = request.block_ids[index], request.block_hashes[index]
            parent, tokens = None, ()  # with images a block's key is more than its tokens: no partial hits on it
            if not request.image_spans:
                parent = self._parent_hash(request, index)
                tokens = tuple(request.token_slice(index * size, (index + 1) * size))
            if self.block_pool.cache_block(block_id, block_hash, parent, tokens) and not confirmed:
                self._unconfirmed.append((block_id, block_hash))

    def settle_speculation(self, request: Request, num_verified: int) -> None:
        """After a verify step: the request's keys and values are valid for its first
        `request.num_computed_tokens` positions, of which those from `num_verified` on were
        accepted proposals. Registers the blocks the accepted tokens complete (their keys and
        values are written) and gives back the blocks that held only rejected tokens."""
        num_computed = request.num_computed_tokens
        if num_computed // self.block_size > num_verified // self.block_size and self.hashes_blocks(request):
            self._cache_full_blocks(request, num_verified, num_computed, confirmed=True)
        self.trim(request)

    def trim(self, request: Request) -> None:
        """Give back the request's blocks past those its first `num_computed_tokens` positions
        use (slots of rejected speculative tokens; a draft model rolled back, core/spec/draft.py)."""
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(request.block_ids) > keep:
            surplus = request.block_ids[keep:]
            del request.block_ids[keep:]
            self.block_pool.free(reversed(surplus))

    def _parent_hash(self, request: Request, index: int) -> bytes:
        """The hash block `index` of the request chains from (its hashes up to index - 1 made)."""
        return request.block_hashes[index - 1] if index else root_hash(self._salt(request))

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        if len(request.block_hashes) < num_tokens // self.block_size:
            extend_block_hashes(request.block_hashes, request.token_slice, num_tokens, self.block_size,
                                self._salt(request), request.block_extra_key if request.image_spans else None)

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool, tail first, and clear its block ids.
        Cached blocks keep their hash (prefix caching off: until no request holds them)."""
        pool = self.block_pool
        pool.free(reversed(request.block_ids))
        if not self.enable_prefix_caching:
            for block_id in request.block_ids:
                if pool.ref_counts[block_id] == 0:
                    pool.uncache(block_id)
        request.block_ids.clear()

    def take_copies(self) -> tuple[KVCopy, ...]:
        """The partial hits' copies of the step being scheduled (and forgets them)."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def confirm(self) -> None:
        """The blocks cached so far hold the keys and values they were registered for."""
        self._unconfirmed.clear()

    def discard_unconfirmed(self) -> None:
        """Forget the hashes registered since the last confirm(): their step never ran."""
        for block_id, block_hash in self._unconfirmed:
            if self.block_pool.block_hashes[block_id] == block_hash:
                self.block_pool.uncache(block_id)
        self._unconfirmed.clear()

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit in the pool when nothing else holds a block."""
        return cdiv(num_tokens, self.block_size) <= self.block_pool.num_usable_blocks
