"""EngineCore: one step = schedule -> run -> sample -> update."""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from ..backend import Backend
from ..capabilities import check_capabilities
from ..config import EngineConfig
from ..execution.decode_batch import decode_rows_only
from .messages import EngineInfo  # torch-free: it crosses to the gateway
from ..grammar import ConstrainedRequests, GrammarCompileService, GrammarError, make_compiler
from ..kv import BlockPool, KVCacheManager
from ..loader import load_hf_tokenizer
from ..params import ValidationError
from ..plugins import select_backend
from ..multimodal.processor import image_prompts_for, prepare_images
from ..pooling.pooler import Pooler
from ..pooling.serving import check_served
from ..scheduling.request import EngineCoreOutput, FinishReason, Request, decide_finish
from ..execution.sampling import Sampler, SampleRow, make_generator, prompt_token_logprobs
from ..scheduling.scheduler import Scheduler
from ..scheduling.output import SchedulerOutput
from ..text.serving_tokenizer import ServingTokenizer
from ..spec.verify import VerifyPlan, rewind
from ..spec.build import build_speculator
from ..spec.draft import check_draft_model
from .shard_worker import (ShardSet, build_shard_model, kv_bytes_per_block, kv_cache_size,  # noqa: F401 - re-export
                           num_kv_blocks_for)

logger = logging.getLogger(__name__)




class EngineCore:
    """`tokenizer` (transformers' or a ServingTokenizer) checks a draft model's vocabulary and,
    if transformers', serves grammars; otherwise transformers' is loaded on the first grammar."""

    def __init__(self, config: EngineConfig, backend: Backend | None = None, tokenizer=None):
        self.backend = backend or select_backend(config.backend)
        # refuses what the backend declares it cannot serve; turns off what it cannot do
        self.config = config = check_capabilities(self.backend.name, self.backend.capabilities(), config)
        block_size = config.cache.block_size
        if config.speculative.enabled and config.speculative.method == "draft":
            check_draft_model(config, tokenizer)  # a draft without the model's tokenizer: one line, nothing loaded
        # rank 0 runs here; this node's other shards start first and join as it loads
        self.shards = ShardSet.start(config, self.backend)
        try:
            built = build_shard_model(config, self.backend, self.shards.shard)
        except BaseException as exc:
            self.shards.shutdown(graceful=False)
            if self.shards.sharded and isinstance(exc, RuntimeError):
                raise self.shards.terminated(exc) from exc
            raise
        self.loaded, num_blocks, self.runner = built.loaded, built.num_blocks, built.runner
        self.config = config = built.config  # a pooling model's serving (core/pooling/serving.py)
        self.pooler = Pooler(self.loaded.pooling) if self.loaded.pooling is not None else None  # embeddings
        self.lora = built.lora  # LoRA adapters (core/lora/manager.py); None: off
        self.image_prompts = image_prompts_for(self.loaded, self.backend)  # None: text only (core/multimodal)
        self.info = EngineInfo(self.backend.name, num_blocks, block_size, self.loaded.max_model_len,
                               self.loaded.eos_token_ids, config.speculative.num_speculative_tokens,
                               self.backend.kernel_isa(), self.backend.quantized_activations(),
                               pooling=self.loaded.pooling,
                               image_token=self.image_prompts.image_token if self.image_prompts else None,
                               lora_adapters=None if self.lora is None else self.lora.names)
        # constrained requests speculate too: their matchers roll back over k proposals
        self.constrained = ConstrainedRequests(self.loaded.vocab_size, self.info.eos_token_ids,
                                               config.speculative.num_speculative_tokens)
        try:
            speculator = build_speculator(config, self.backend, self.loaded, num_blocks, self.constrained)
        except BaseException:
            self.shards.shutdown()
            raise
        self.scheduler = Scheduler.for_engine(config, num_blocks, speculator)
        self.sampler = Sampler(config.sampling_seed)
        self._generators: dict[str, torch.Generator] = {}
        self.last_scheduler_output: SchedulerOutput | None = None  # for step metrics
        self.last_num_accepted = 0  # speculative tokens the last step accepted (step metrics)
        self._prompt_logprobs: dict[str, list] = {}  # request id -> scored prompt tokens so far
        self._tokenizer = tokenizer
        self.grammar_service = GrammarCompileService(self._make_grammar_compiler, config.grammar,
                                                     cpus=config.parallel.cpus)
        # constrained requests whose grammar is still compiling: held here, out of the scheduler
        self._awaiting_grammar: dict[str, tuple[Request, Future]] = {}
        kv = kv_cache_size(self.loaded, num_blocks)
        logger.info("engine ready: backend=%s, %s%s%s", self.backend.name, kv.describe(),
                    " on each shard (its heads)" if self.shards.sharded else "",
                    "" if self.lora is None else f"; {self.lora.describe()}")
        if self.info.max_batch_total_tokens < self.info.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than the context of %d: a longer request is "
                           "refused", self.info.max_batch_total_tokens, self.info.max_model_len)

    def add_request(self, request: Request) -> None:
        """Validates against the engine's limits (raises ValidationError) and queues.

        A constrained request whose grammar is cached (or failed to compile: GrammarError)
        is settled at once; otherwise it waits here, off the step, until its grammar is
        compiled, and a failure then comes back as its output's `error`."""
        check_served(request, self.info.pooling)  # embeddings to a pooling model, generation to the others
        self._admit_adapter(request)
        prepare_images(self.image_prompts, request)  # expands its image placeholders (core/multimodal)
        request.max_model_len = min(request.max_model_len, self.info.max_model_len)
        if not request.eos_token_ids:
            request.eos_token_ids = self.info.eos_token_ids
        spec = request.sampling_params.grammar
        if spec is None:
            self._queue(request)
            return
        if request.request_id in self._awaiting_grammar:
            raise ValidationError(f"request id {request.request_id!r} is already in use")
        future = self.grammar_service.compile(spec)
        if future.done():
            self._queue(request, future.result())
        else:
            self._awaiting_grammar[request.request_id] = (request, future)

    def _admit_adapter(self, request: Request) -> None:
        """A request's LoRA adapter must be served (ValidationError); its prefix-cache salt names it."""
        if self.lora is not None:
            self.lora.admit(request)
        elif request.lora_name is not None:
            raise ValidationError(f"LoRA adapter {request.lora_name!r} requested, but LoRA adapters are not served "
                                  "(--lora-adapters, --enable-lora)", "model")

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (LoadLora); raises, changing nothing, if it cannot."""
        self.serve_lora(self.read_lora(name, path))

    def read_lora(self, name: str, path: str):
        """The adapter at `path` read and checked, not yet served: touches no state a step uses,
        so the engine loop runs it beside steps (core/engine/loop.py); then serve_lora."""
        if self.lora is None:
            raise ValidationError("LoRA adapters are not served (start with --enable-lora)")
        return self.lora.read(name, path)

    def serve_lora(self, adapter) -> None:
        """Serve an adapter read_lora gave, between steps."""
        self.lora.serve(adapter)

    def unload_lora(self, name: str) -> None:
        """New requests may no longer name `name` (UnloadLora); those in flight finish with it."""
        if self.lora is None:
            raise ValidationError("LoRA adapters are not served (start with --enable-lora)")
        self.lora.unload(name, in_use=name in self._adapters_in_use())

    def _release_adapters(self) -> None:
        """Drops the unloaded LoRA adapters whose last requests have ended."""
        if self.lora is not None and self.lora.retiring:
            self.lora.release_unused(self._adapters_in_use())

    def _adapters_in_use(self) -> set[str]:
        requests = list(self.scheduler.requests.values()) + [r for r, _ in self._awaiting_grammar.values()]
        return {r.lora_name for r in requests if r.lora_name is not None}

    def _queue(self, request: Request, compiled=None) -> None:
        self.scheduler.add_request(request)
        if compiled is not None:
            self.constrained.add(request.request_id, compiled, request.sampling_params.grammar.gate)
        if not request.sampling_params.greedy and request.sampling_params.seed is not None:
            self._generators[request.request_id] = make_generator(request.sampling_params.seed,
                                                                  self.backend.device)

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        self._awaiting_grammar.pop(request_id, None)
        self.constrained.remove(request_id)
        self.scheduler.finish_request(request_id, reason)
        self._generators.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        if self.pooler is not None:
            self.pooler.forget(request_id)
        self._release_adapters()

    def check_health(self) -> None:
        """Raises ShardTerminated (core/errors.py) if one of the engine's shard processes has
        ended. Cheap; the engine's owner calls it between steps and while idle."""
        self.shards.check()

    def shutdown(self) -> None:
        """Stops what the engine started: its grammar workers and its shard processes."""
        self.grammar_service.shutdown()
        self.shards.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._awaiting_grammar)

    def step(self) -> list[EngineCoreOutput]:
        started = time.perf_counter()
        failed = self._queue_compiled() if self._awaiting_grammar else []
        scheduler_output = self.scheduler.schedule()
        self.last_scheduler_output = scheduler_output
        self.last_num_accepted = 0
        if scheduler_output.is_empty:
            if self._awaiting_grammar and not failed:
                wait([f for _, f in self._awaiting_grammar.values()], timeout=0.05, return_when=FIRST_COMPLETED)
            return failed
        logits, request_ids = self.shards.execute(self.runner, scheduler_output)
        if self.runner.last_prompt_logits:
            self._score_prompt_chunks(scheduler_output)
        pooled = [] if self.pooler is None else self.pooler.step(  # before update() forgets them
            scheduler_output.scheduled, self.runner.last_pooling_hidden, self.scheduler.get_request)
        if not request_ids:
            self.scheduler.update(scheduler_output, {})
            return failed + pooled
        outputs = self._sample_and_update(scheduler_output, logits, request_ids) + pooled
        self._release_adapters()
        speculator = self.scheduler.speculator
        if speculator is not None and decode_rows_only(scheduler_output):  # what a row costs (core/spec/cost.py)
            speculator.observe_step(scheduler_output.num_batched_tokens, time.perf_counter() - started)
        return failed + outputs

    def _sample_and_update(self, scheduler_output: SchedulerOutput, logits: torch.Tensor,
                           request_ids: tuple[str, ...]) -> list[EngineCoreOutput]:
        """Sample every row (a verifying request's k + 1 positions, core/spec/verify.py), keep
        each request's accepted run, advance grammars and the scheduler; the step's outputs."""
        requests = [self.scheduler.get_request(rid) for rid in request_ids]
        plan = VerifyPlan.of(scheduler_output, request_ids)
        grammar_mask = self.constrained.mask(plan.row_request_ids, plan.drafts_by_request)  # before the rows' bans
        rows = [row for request, drafts in zip(requests, plan.drafts) for row in self._sample_rows(request, drafts)]
        rewinds = self._generator_states(plan)
        sampled = self.sampler(logits, rows, grammar_mask)
        token_ids = {rid: plan.accepted(i, sampled.token_ids) for i, rid in enumerate(request_ids)}
        rejected = self._advance_grammars(token_ids) if grammar_mask is not None else ()
        self.last_num_accepted = sum(len(t) - 1 for t in token_ids.values())
        for rid, state in rewinds.items():
            rewind(self._generators[rid], state, len(token_ids[rid]), logits.shape[-1])
        num_before = [len(r.output_token_ids) for r in requests]
        finished = self.scheduler.update(scheduler_output, token_ids)
        reasons = {r.request_id: r.finish_reason for r in finished}
        if grammar_mask is not None:
            self._finish_complete_grammars(list(dict.fromkeys(plan.row_request_ids[i] for i in grammar_mask.rows)),
                                           reasons)
        for rid in reasons:
            self._generators.pop(rid, None)
            self.constrained.remove(rid)
        failed = [self._fail(rid, GrammarError("the grammar rejected the sampled token (internal error)"))
                  for rid in rejected]
        outputs = []
        for i, (rid, request) in enumerate(zip(request_ids, requests)):
            # the tokens the scheduler appended: a stop inside an accepted run ends it there
            count, first = len(request.output_token_ids) - num_before[i], plan.starts[i]
            outputs.append(EngineCoreOutput(
                rid, tuple(token_ids[rid][:count]), reasons.get(rid),
                tuple(sampled.logprobs[first:first + count]) if sampled.logprobs else None,
                tuple(tuple(t) for t in sampled.top_logprobs[first:first + count]) if sampled.top_logprobs else None,
                self._take_prompt_logprobs(request)))
        return failed + outputs

    def _generator_states(self, plan: VerifyPlan) -> dict[str, torch.Tensor]:
        """The generator state of each seeded request that verifies proposals, before sampling:
        its k + 1 positions draw k + 1 times, and it is rewound to as many draws as tokens it
        keeps, so a seed gives the same tokens as without speculation."""
        return {rid: self._generators[rid].get_state() for rid, drafts in zip(plan.request_ids, plan.drafts)
                if drafts and rid in self._generators}

    def _queue_compiled(self) -> list[EngineCoreOutput]:
        """Queue the waiting requests whose grammar is now compiled; fail those it failed."""
        failed = []
        for request_id, (request, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[request_id]
            try:
                self._queue(request, future.result())
            except ValidationError as exc:  # GrammarError, or the engine's limits
                failed.append(EngineCoreOutput(request_id, (), FinishReason.ABORT, error=exc))
        return failed

    def _advance_grammars(self, token_ids: dict[str, list[int]]) -> list[str]:
        """Advance each constrained request's matcher by the tokens it keeps, cutting its run
        after the token that completes its grammar (as without speculation, nothing follows
        it); the ids of any whose grammar rejected a token."""
        rejected = []
        for rid, tokens in token_ids.items():
            if rid in self.constrained:
                count = self.constrained.accept_run(rid, tokens)
                if count is None:
                    rejected.append(rid)
                else:
                    del tokens[count:]
        return rejected

    def _finish_complete_grammars(self, request_ids: list[str], reasons: dict) -> None:
        """Requests whose grammar is complete end (decide_finish weighs that against the
        scheduler's reason, if it found one this step)."""
        for rid in request_ids:
            if rid not in self.constrained or not self.constrained.is_complete(rid):
                continue
            if rid not in reasons:
                self.scheduler.finish_request(rid, FinishReason.GRAMMAR)
            reasons[rid] = decide_finish(reasons.get(rid), FinishReason.GRAMMAR)

    def _fail(self, request_id: str, error: BaseException) -> EngineCoreOutput:
        self.finish_request(request_id, FinishReason.ABORT)
        return EngineCoreOutput(request_id, (), FinishReason.ABORT, error=error)

    def _make_grammar_compiler(self):
        """Runs on a grammar worker the first time a grammar is compiled. The compilers take
        transformers' tokenizer: one the engine was given, else loaded here (an engine that
        serves with a ServingTokenizer imports transformers only now)."""
        tokenizer = self._tokenizer
        if tokenizer is None or isinstance(tokenizer, ServingTokenizer):
            tokenizer = load_hf_tokenizer(self.config.model)
        return make_compiler(self.config.grammar, tokenizer, self.loaded.vocab_size, self.info.eos_token_ids)

    def _score_prompt_chunks(self, scheduler_output: SchedulerOutput) -> None:
        """Log-probabilities of the prompt tokens this step's positions predicted."""
        starts = {s.request_id: s.num_computed_tokens for s in scheduler_output.scheduled}
        for rid, logits in self.runner.last_prompt_logits.items():
            request = self.scheduler.get_request(rid)
            first = starts[rid] + 1
            targets = request.prompt_token_ids[first:first + logits.shape[0]]
            scored = prompt_token_logprobs(logits, targets, request.sampling_params.prompt_logprobs)
            if starts[rid] == 0:  # the first chunk, or a recompute after preemption: start over
                self._prompt_logprobs[rid] = []
            self._prompt_logprobs.setdefault(rid, []).extend(scored)
        self.runner.last_prompt_logits = {}

    def _take_prompt_logprobs(self, request: Request):
        """With the first sampled token: one entry per prompt token, the first unscored."""
        if request.sampling_params.prompt_logprobs is None or len(request.output_token_ids) != 1:
            return None
        scored = self._prompt_logprobs.pop(request.request_id, [])
        return ((request.prompt_token_ids[0], None, ()),) + tuple(scored)

    def _sample_rows(self, request: Request, drafts: tuple[int, ...]) -> list[SampleRow]:
        """One row per position the request samples: its next token, and after each proposed
        token the one that would follow it (the outputs then include the proposals before it,
        so penalties and min_tokens see what they would see without speculation)."""
        rows = [self._sample_row(request, request.output_token_ids)]
        for j in range(1, len(drafts) + 1):
            rows.append(self._sample_row(request, request.output_token_ids + list(drafts[:j]), j))
        return rows

    def _sample_row(self, request: Request, output_token_ids: list[int], position: int = 0) -> SampleRow:
        """`position`: how many proposals precede the row (its grammar row, for the bans)."""
        params = request.sampling_params
        banned: tuple[int, ...] = ()
        if len(output_token_ids) < params.min_tokens:
            banned = params.stop_token_ids + (() if params.ignore_eos else request.eos_token_ids)
            banned = self.constrained.feasible_bans(request.request_id, banned, position)
        return SampleRow(request.request_id, params, self._generators.get(request.request_id),
                         request.prompt_token_ids, output_token_ids, banned)
