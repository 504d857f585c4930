"""A fake model runner that drives Scheduler.schedule()/update() without torch.

It keeps a fake paged KV cache that stores token ids instead of keys and values:
each step writes the scheduled tokens into the slots their block table names, and
a request that samples reads its whole context back through its block table. The
fake sampler is a function of that context only, so a wrong block table, a block
shared by two requests or a bad recompute after preemption changes the outputs.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from switchyard.core.kv import RESERVED_BLOCK_ID, BlockPool, KVCacheManager, cdiv
from switchyard.core.config import SchedulerConfig
from switchyard.core.params import SamplingParams
from switchyard.core.request import FinishReason, Request
from switchyard.core.scheduler import Scheduler
from switchyard.core.scheduler_output import SchedulerOutput

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
                   max_num_seqs: int = 8, mixed_prefill_decode: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             mixed_prefill_decode=mixed_prefill_decode)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size))


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int | None = 8,
                 eos: tuple[int, ...] = (), max_model_len: int = 1 << 30, **params) -> Request:
    if isinstance(prompt, int):
        prompt = [(zlib.crc32(request_id.encode()) + i) % VOCAB_SIZE for i in range(prompt)]
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=eos, max_model_len=max_model_len)


@dataclass
class FakeRunner:
    scheduler: Scheduler
    sampler: Sampler = context_sampler
    outputs: list[SchedulerOutput] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        self.block_size = self.scheduler.kv_cache_manager.block_size
        self.slots: list[list[int | None]] = [[None] * self.block_size for _ in range(pool.num_blocks)]

    def step(self) -> list[Request]:
        """One engine step: schedule, 'run the model', sample, update."""
        output = self.scheduler.schedule()
        if self.scheduler.has_unfinished_requests():
            assert not output.is_empty, "the scheduler stalled with unfinished requests"
        sampled = self.execute(output)
        finished = self.scheduler.update(output, sampled)
        self.outputs.append(output)
        self.finished += finished
        check_invariants(self.scheduler)
        return finished

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        config = self.scheduler.config
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        assert len({s.request_id for s in output.scheduled}) == len(output.scheduled)
        sampled: dict[str, int] = {}
        for scheduled in output.scheduled:
            assert RESERVED_BLOCK_ID not in scheduled.block_ids
            assert len(scheduled.block_ids) == cdiv(scheduled.seq_len, self.block_size)
            for offset, token_id in enumerate(scheduled.token_ids):
                self._write(scheduled.block_ids, scheduled.num_computed_tokens + offset, token_id)
            if scheduled.samples:
                context = tuple(self._read(scheduled.block_ids, pos) for pos in range(scheduled.seq_len))
                request = self.scheduler.get_request(scheduled.request_id)
                if request is not None:  # None: aborted after it was scheduled
                    assert list(context) == request.all_token_ids, "the KV cache lost the request's context"
                sampled[scheduled.request_id] = self.sampler(scheduled.request_id, context)
        return sampled

    def run_until_done(self, max_steps: int = 10_000) -> list[Request]:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return self.finished
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def _write(self, block_ids: tuple[int, ...], position: int, token_id: int) -> None:
        self.slots[block_ids[position // self.block_size]][position % self.block_size] = token_id

    def _read(self, block_ids: tuple[int, ...], position: int) -> int:
        token_id = self.slots[block_ids[position // self.block_size]][position % self.block_size]
        assert token_id is not None, f"position {position} was never written"
        return token_id


def check_invariants(scheduler: Scheduler) -> None:
    """Every usable block is either free or owned by exactly one unfinished request."""
    pool = scheduler.kv_cache_manager.block_pool
    owners: dict[int, str] = {}
    for request in scheduler.running:
        for block_id in request.block_ids:
            assert block_id not in owners, f"block {block_id} owned by {owners[block_id]} and {request.request_id}"
            owners[block_id] = request.request_id
    for request in scheduler.waiting:
        assert not request.block_ids and request.num_computed_tokens == 0
    assert RESERVED_BLOCK_ID not in owners and pool.ref_counts[RESERVED_BLOCK_ID] == 0
    for block_id in range(1, pool.num_blocks):
        assert pool.ref_counts[block_id] == (1 if block_id in owners else 0)
        assert pool.is_free(block_id) == (block_id not in owners)
    assert pool.num_free_blocks + len(owners) == pool.num_usable_blocks
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    assert set(scheduler.requests) == {r.request_id for r in [*scheduler.running, *scheduler.waiting]}


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
