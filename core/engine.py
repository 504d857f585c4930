"""EngineCore: one step = schedule -> run -> sample -> update."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .backend import Backend
from .config import CacheConfig, EngineConfig
from .kv import BlockPool, KVCacheManager
from .loader import LoadedModel, load_model
from .plugins import select_backend
from .request import EngineCoreOutput, FinishReason, Request
from .sampling import Sampler, SampleRow, make_generator, prompt_token_logprobs
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    backend: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    @property
    def max_batch_total_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size


def num_kv_blocks_for(cache: CacheConfig, loaded: LoadedModel, backend: Backend) -> int:
    """KV capacity in blocks: the configured count, else what the free memory allows."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    spec = loaded.attention_spec
    bytes_per_block = (2 * loaded.num_layers * spec.block_size * spec.num_kv_heads * spec.head_dim
                       * torch.empty((), dtype=spec.dtype).element_size())
    return backend.num_kv_blocks(bytes_per_block, cache)


class EngineCore:
    def __init__(self, config: EngineConfig, backend: Backend | None = None):
        self.config = config
        self.backend = backend or select_backend(config.backend)
        self.backend.init_device()
        block_size = config.cache.block_size
        self.loaded = load_model(config.model, self.backend, block_size)
        self.backend.profile_run(self.loaded, config)
        num_blocks = num_kv_blocks_for(config.cache, self.loaded, self.backend)
        kv_caches = self.backend.allocate_kv_cache(self.loaded.num_layers, num_blocks, self.loaded.attention_spec)
        self.runner = self.backend.make_runner(self.loaded, kv_caches, config)
        self.scheduler = Scheduler(config.scheduler, KVCacheManager(BlockPool(num_blocks), block_size))
        self.sampler = Sampler()
        self.info = EngineInfo(self.backend.name, num_blocks, block_size, self.loaded.max_model_len,
                               self.loaded.eos_token_ids)
        self._generators: dict[str, torch.Generator] = {}
        self.last_scheduler_output: SchedulerOutput | None = None  # for step metrics
        self._prompt_logprobs: dict[str, list] = {}  # request id -> scored prompt tokens so far
        logger.info("engine ready: backend=%s kv_blocks=%d (%d tokens)", self.backend.name, num_blocks,
                    self.info.max_batch_total_tokens)

    def add_request(self, request: Request) -> None:
        """Validates against the engine's limits (raises ValidationError) and queues."""
        request.max_model_len = min(request.max_model_len, self.info.max_model_len)
        if not request.eos_token_ids:
            request.eos_token_ids = self.info.eos_token_ids
        self.scheduler.add_request(request)
        if not request.sampling_params.greedy and request.sampling_params.seed is not None:
            self._generators[request.request_id] = make_generator(request.sampling_params.seed,
                                                                  self.backend.device)

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        self.scheduler.finish_request(request_id, reason)
        self._generators.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        self.last_scheduler_output = scheduler_output
        if scheduler_output.is_empty:
            return []
        logits, request_ids = self.runner.execute(scheduler_output)
        if self.runner.last_prompt_logits:
            self._score_prompt_chunks(scheduler_output)
        if not request_ids:
            self.scheduler.update(scheduler_output, {})
            return []
        requests = [self.scheduler.get_request(rid) for rid in request_ids]
        sampled = self.sampler(logits, [self._sample_row(r) for r in requests])
        finished = self.scheduler.update(scheduler_output, dict(zip(request_ids, sampled.token_ids)))
        reasons = {r.request_id: r.finish_reason for r in finished}
        for rid in reasons:
            self._generators.pop(rid, None)
        return [
            EngineCoreOutput(rid, (token,), reasons.get(rid),
                             sampled.logprobs[i] if sampled.logprobs else None,
                             tuple(sampled.top_logprobs[i]) if sampled.top_logprobs else None,
                             self._take_prompt_logprobs(requests[i]))
            for i, (rid, token) in enumerate(zip(request_ids, sampled.token_ids))
        ]

    def _score_prompt_chunks(self, scheduler_output: SchedulerOutput) -> None:
        """Log-probabilities of the prompt tokens this step's positions predicted."""
        starts = {s.request_id: s.num_computed_tokens for s in scheduler_output.scheduled}
        for rid, logits in self.runner.last_prompt_logits.items():
            request = self.scheduler.get_request(rid)
            first = starts[rid] + 1
            targets = request.prompt_token_ids[first:first + logits.shape[0]]
            scored = prompt_token_logprobs(logits, targets, request.sampling_params.prompt_logprobs)
            self._prompt_logprobs.setdefault(rid, []).extend(scored)
        self.runner.last_prompt_logits = {}

    def _take_prompt_logprobs(self, request: Request):
        """With the first sampled token: one entry per prompt token, the first unscored."""
        if request.sampling_params.prompt_logprobs is None or len(request.output_token_ids) != 1:
            return None
        scored = self._prompt_logprobs.pop(request.request_id, [])
        return ((request.prompt_token_ids[0], None, ()),) + tuple(scored)

    def _sample_row(self, request: Request) -> SampleRow:
        params = request.sampling_params
        banned: tuple[int, ...] = ()
        if len(request.output_token_ids) < params.min_tokens:
            banned = params.stop_token_ids + (() if params.ignore_eos else request.eos_token_ids)
        return SampleRow(request.request_id, params, self._generators.get(request.request_id),
                         request.prompt_token_ids, request.output_token_ids, banned)
