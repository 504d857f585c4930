"""A fake model runner that drives Scheduler.schedule()/update() without torch.

It keeps a fake paged KV cache that stores token ids instead of keys and values:
like the real attention call site, each step first writes every scheduled token of
the batch into the slots its block table names, then each request that samples
reads its whole context back through its block table. The fake sampler is a
function of that context only, so a wrong block table, a block shared wrongly, a
cache hit on the wrong tokens or a bad recompute after preemption changes the
outputs. Two writes to one slot in a step, or a write that changes a slot of a
cached block since it was cached, fail at once (cached blocks must be immutable);
after every step the cached blocks requests hold are compared with their tokens.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from switchyard.core.kv import RESERVED_BLOCK_ID, BlockPool, KVCacheManager, cdiv
from switchyard.core.config import SchedulerConfig
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import FinishReason, Request
from switchyard.core.scheduling.scheduler import Scheduler
from switchyard.core.scheduling.output import SchedulerOutput

# (request_id, context read from the KV cache) -> next token id
Sampler = Callable[[str, tuple[int, ...]], int]
VOCAB_SIZE = 1000


def context_sampler(request_id: str, context: tuple[int, ...]) -> int:
    """Deterministic 'model': the next token depends on the whole context."""
    acc = len(context)
    for token_id in context:
        acc = (acc * 1_000_003 + token_id) % 2_147_483_647
    return acc % VOCAB_SIZE


def scripted_sampler(scripts: dict[str, list[int]], prompt_lens: dict[str, int],
                     fallback: int = 7) -> Sampler:
    """Output number k of a request is scripts[id][k] (then `fallback`)."""
    def sample(request_id: str, context: tuple[int, ...]) -> int:
        script = scripts.get(request_id, [])
        index = len(context) - prompt_lens[request_id]
        return script[index] if index < len(script) else fallback
    return sample


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 8, mixed_prefill_decode: bool = True, enable_prefix_caching: bool = True,
                   partial_hits: bool = True, **policy) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             mixed_prefill_decode=mixed_prefill_decode, **policy)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size, enable_prefix_caching, partial_hits))


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int | None = 8,
                 eos: tuple[int, ...] = (), max_model_len: int = 1 << 30, share_group: str | None = None,
                 cache_salt: str | None = None, **params) -> Request:
    if isinstance(prompt, int):
        prompt = [(zlib.crc32(request_id.encode()) + i) % VOCAB_SIZE for i in range(prompt)]
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=eos, max_model_len=max_model_len, share_group=share_group,
                   cache_salt=cache_salt)


@dataclass
class FakeRunner:
    scheduler: Scheduler
    sampler: Sampler = context_sampler
    outputs: list[SchedulerOutput] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens the 'model' computed, over all steps

    def __post_init__(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        self.block_size = self.scheduler.kv_cache_manager.block_size
        self.slots: list[list[int | None]] = [[None] * self.block_size for _ in range(pool.num_blocks)]
        # the hash the block had when each slot was last written (a new hash = new contents)
        self.written_under: list[list[bytes | None]] = [[None] * self.block_size for _ in range(pool.num_blocks)]

    def step(self) -> list[Request]:
        """One engine step: schedule, 'run the model', sample, update."""
        output = self.scheduler.schedule()
        if self.scheduler.has_unfinished_requests():
            assert not output.is_empty, "the scheduler stalled with unfinished requests"
        sampled = self.execute(output)
        finished = self.scheduler.update(output, sampled)
        self.outputs.append(output)
        self.finished += finished
        check_invariants(self.scheduler, self)
        return finished

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        config = self.scheduler.config
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        assert len({s.request_id for s in output.scheduled}) == len(output.scheduled)
        if not config.mixed_prefill_decode:  # prefill-only or decode-only
            kinds = {self._is_decode(s) for s in output.scheduled}
            assert len(kinds) <= 1, "a step mixed prefill and decode"
        self._written: set[tuple[int, int]] = set()
        pool = self.scheduler.kv_cache_manager.block_pool
        for copy in output.kv_copies:  # partial prefix hits, before anything of the step is written
            assert None not in self.slots[copy.source][:copy.num_slots], "a copy of slots never written"
            self.slots[copy.target][:copy.num_slots] = self.slots[copy.source][:copy.num_slots]
            self.written_under[copy.target][:copy.num_slots] = [pool.block_hashes[copy.target]] * copy.num_slots
        for scheduled in output.scheduled:  # write_kv of the whole batch ...
            assert RESERVED_BLOCK_ID not in scheduled.block_ids
            assert len(scheduled.block_ids) == cdiv(scheduled.seq_len, self.block_size)
            for offset, token_id in enumerate(scheduled.token_ids):
                self._write(scheduled.block_ids, scheduled.num_computed_tokens + offset, token_id)
        sampled: dict[str, int] = {}
        for scheduled in output.scheduled:  # ... before any attention read
            self.num_computed_tokens += scheduled.num_new_tokens
            if scheduled.samples:
                context = tuple(self._read(scheduled.block_ids, pos) for pos in range(scheduled.seq_len))
                request = self.scheduler.get_request(scheduled.request_id)
                if request is not None:  # None: aborted after it was scheduled
                    assert list(context) == request.all_token_ids, "the KV cache lost the request's context"
                sampled[scheduled.request_id] = self.sampler(scheduled.request_id, context)
        return sampled

    def _is_decode(self, scheduled) -> bool:
        """A decode computes the one token left past the prompt (anything else is a prefill: also
        a one-token chunk of a preempted request's recompute that the budget cut short)."""
        request = self.scheduler.get_request(scheduled.request_id)
        if request is None:
            return False
        return (scheduled.num_new_tokens == 1 and scheduled.num_computed_tokens >= request.num_prompt_tokens
                and scheduled.num_computed_tokens + 1 == request.num_tokens)

    def run_until_done(self, max_steps: int = 10_000) -> list[Request]:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return self.finished
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def _write(self, block_ids: tuple[int, ...], position: int, token_id: int) -> None:
        block_hash = self.scheduler.kv_cache_manager.block_pool.block_hashes[block_id := block_ids[
            position // self.block_size]]
        slot = position % self.block_size
        assert (block_id, slot) not in self._written, f"slot {slot} of block {block_id} written twice in a step"
        self._written.add((block_id, slot))
        if block_hash is not None and self.written_under[block_id][slot] == block_hash:
            assert self.slots[block_id][slot] == token_id, f"cached block {block_id} overwritten"
        self.slots[block_id][slot] = token_id
        self.written_under[block_id][slot] = block_hash

    def _read(self, block_ids: tuple[int, ...], position: int) -> int:
        token_id = self.slots[block_ids[position // self.block_size]][position % self.block_size]
        assert token_id is not None, f"position {position} was never written"
        return token_id


def check_invariants(scheduler: Scheduler, runner: FakeRunner | None = None) -> None:
    """Block accounting after a step (or between steps):
    - a block's ref count is the number of unfinished requests holding it; free blocks
      (ref count 0) are exactly those in the free queue; free + held = all usable;
    - a request holds a block at most once, and exactly the blocks its computed
      tokens need (waiting requests hold none);
    - every cached block's hash maps back to it, and a held cached block sits at the
      position of its request whose chain hash it carries (so it holds those tokens:
      with a runner, its slots are checked against the request's tokens).
    """
    pool, manager = scheduler.kv_cache_manager.block_pool, scheduler.kv_cache_manager
    holders: dict[int, int] = {}
    for request in scheduler.running:
        assert len(set(request.block_ids)) == len(request.block_ids)
        assert len(request.block_ids) == cdiv(request.num_computed_tokens, manager.block_size)
        for index, block_id in enumerate(request.block_ids):
            holders[block_id] = holders.get(block_id, 0) + 1
            _check_cached_block(pool, runner, request, index, block_id, manager.block_size)
    for request in scheduler.waiting:
        assert not request.block_ids and request.num_computed_tokens == 0
    assert RESERVED_BLOCK_ID not in holders and pool.ref_counts[RESERVED_BLOCK_ID] == 0
    for block_id in range(1, pool.num_blocks):
        assert pool.ref_counts[block_id] == holders.get(block_id, 0), f"block {block_id}"
        assert pool.is_free(block_id) == (block_id not in holders)
        block_hash = pool.block_hashes[block_id]
        if block_hash is not None:
            assert pool.cached_block(block_hash) == block_id
    assert pool.num_cached_blocks == sum(h is not None for h in pool.block_hashes)
    if not manager.enable_prefix_caching:  # hashes live only as long as a holder
        assert all(pool.block_hashes[b] is None for b in range(1, pool.num_blocks) if pool.is_free(b))
    assert pool.num_free_blocks + len(holders) == pool.num_usable_blocks
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    assert set(scheduler.requests) == {r.request_id for r in [*scheduler.running, *scheduler.waiting]}


def _check_cached_block(pool, runner, request, index, block_id, block_size) -> None:
    block_hash = pool.block_hashes[block_id]
    if block_hash is None:
        return
    assert index < len(request.block_hashes) and request.block_hashes[index] == block_hash, \
        f"{request.request_id} holds cached block {block_id} at a position whose tokens differ"
    if runner is not None:
        tokens = request.all_token_ids[index * block_size:(index + 1) * block_size]
        assert runner.slots[block_id] == tokens, f"cached block {block_id} holds other tokens"


def reference_generate(request: Request, sampler: Sampler, capacity_tokens: int) -> tuple[list[int], FinishReason]:
    """The outputs a request must get, computed without a scheduler (the oracle)."""
    params = request.sampling_params
    context = list(request.prompt_token_ids)
    limit = min(request.max_num_tokens, capacity_tokens)
    outputs: list[int] = []
    while True:
        token_id = sampler(request.request_id, tuple(context))
        context.append(token_id)
        outputs.append(token_id)
        if len(outputs) >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return outputs, FinishReason.EOS
            if token_id in params.stop_token_ids:
                return outputs, FinishReason.STOP_TOKEN
        if len(context) >= limit:
            return outputs, FinishReason.LENGTH


def assert_matches_reference(runner: FakeRunner, requests: list[Request]) -> None:
    """Each request's outputs and finish reason equal a generation on its own."""
    capacity = runner.scheduler.kv_cache_manager.capacity_tokens
    for request in requests:
        outputs, reason = reference_generate(request, runner.sampler, capacity)
        assert (request.output_token_ids, request.finish_reason) == (outputs, reason), request.request_id
