"""Continuous batching with vLLM v1's token catch-up policy. Pure Python, no torch.

Every request has `num_tokens` (prompt + outputs) and `num_computed_tokens`; each
step hands out tokens so that the computed count catches up: one token for a
decode, a chunk of the prompt for a prefill, all within one token budget
(SchedulerConfig.max_num_batched_tokens, TGI's --max-batch-prefill-tokens; as in
TGI's chunking mode the decodes of a step count against it).

Order within a step: decodes of running requests first (so running streams never
stall behind a long prompt), then the next prompt chunks of running requests, then
admissions from the FCFS queue, each starting after its longest cached prefix.
Blocks short: the last-admitted request that is not scheduled in this step is
preempted (recomputed later; its hashed blocks usually survive in the cache), a
prompt chunk shrinks to the room left, and a step that preempted or left a running
request without room admits nobody, so the head of the queue is never overtaken.

Speculative decoding (core/spec): the speculator is asked once per step for the proposals of
every decode (so a draft model runs one batched forward per proposed position); a decode whose
request has proposals (and room for them in the budget and the block pool; they never preempt
anyone) is scheduled as its last token plus the proposed ones; `update()` takes the accepted
run, rolls the computed count back to it and gives back the blocks that held only rejected tokens.

Pooling requests (core/pooling: embeddings) are prompts only: their chunks are scheduled as any
prompt's, they never decode, and `update()` finishes each (FinishReason.POOLED, its blocks
freed) in the step that computes its last token. With `chunk_prompts` off (encoders, whose
tokens attend to the whole prompt) a prompt is admitted only when all of it fits the step.

Backends that cannot mix prefill and decode get steps of one kind (prefill_policy.py).
With LoRA adapters (core/lora), at most max_loras adapters are among the running requests, so a
step never needs more adapter slots than there are (adapters.py says who waits).
The engine calls `schedule()`, runs the model, samples, then `update()`, on one
thread; aborts and stop strings go through `finish_request()` between steps.
"""
from __future__ import annotations

import time
from collections import deque

from ..config import EngineConfig, SchedulerConfig
from ..kv import BlockPool, KVCacheManager
from ..multimodal.inputs import spans_in
from ..multimodal.positions import position_shift
from .encoder_budget import fit_images, stop_outside_images
from ..params import ValidationError
from .adapters import AdapterLimit
from .prefill_policy import PrefillPolicy
from .request import FinishReason, Request, RequestStatus, decide_finish
from .output import ScheduledRequest, SchedulerOutput, StepDraft
from ..spec import Speculator


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 speculator: Speculator | None = None, max_loras: int | None = None):
        if scheduler_config.max_num_batched_tokens < 1 or scheduler_config.max_num_seqs < 1:
            raise ValueError(f"the token budget and the batch size must be positive: {scheduler_config}")
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.speculator = speculator  # None: no speculative decoding
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go back to the front
        self.running: list[Request] = []  # in admission order; the last is preempted first
        self.num_preemptions = 0  # over the scheduler's life, for metrics and tests
        self.prefill_policy = None if scheduler_config.mixed_prefill_decode else PrefillPolicy(
            scheduler_config.waiting_served_ratio, scheduler_config.max_waiting_tokens)
        self._awaiting_update = False  # schedule() returned an output update() has not seen
        # LoRA (core/lora): at most max_loras adapters among the running requests; None: LoRA off
        self.adapter_limit = AdapterLimit(max_loras) if max_loras is not None else None

    @classmethod
    def for_engine(cls, config: EngineConfig, num_blocks: int, speculator: Speculator | None = None) -> Scheduler:
        """The configured policy; the engine has already narrowed `config` to what its backend
        can do (core/capabilities.py) and built the speculator (core/spec/build.py), if any."""
        return cls(config.scheduler, KVCacheManager(BlockPool(num_blocks), config.cache.block_size,
                                                    config.cache.enable_prefix_caching,
                                                    config.cache.partial_prefix_hits), speculator,
                   config.lora.max_loras if config.lora.enabled else None)

    # ---- admission -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValidationError if it can never produce a token."""
        if request.request_id in self.requests:
            raise ValidationError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValidationError("the prompt must contain at least one token", "prompt")
        # a generation request needs room for one generated token; a pooling one only its prompt
        num_tokens, more = (request.num_prompt_tokens, "") if request.pooling is not None else \
            (request.num_prompt_tokens + 1, "with one generated token ")
        if num_tokens > request.max_model_len:
            raise ValidationError(
                f"the prompt has {request.num_prompt_tokens} tokens; {more}that "
                f"exceeds the context length of {request.max_model_len} tokens", "prompt")
        # Cached blocks are evictable, so the whole pool is the bound with or without prefix caching.
        if not self.kv_cache_manager.can_ever_fit(num_tokens):
            raise ValidationError(
                f"the prompt has {request.num_prompt_tokens} tokens; {more}that "
                f"exceeds the KV cache capacity of {self.kv_cache_manager.capacity_tokens} tokens", "prompt")
        if not self.config.chunk_prompts and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValidationError(
                f"the prompt has {request.num_prompt_tokens} tokens; this model computes a prompt in one step, "
                f"whose token budget is {self.config.max_num_batched_tokens} (--max-batch-prefill-tokens)", "prompt")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # ---- one step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._awaiting_update:  # the last step never ran: its new hashes describe nothing
            self.kv_cache_manager.discard_unconfirmed()
        self._awaiting_update = True
        draft = StepDraft(self.config.max_num_batched_tokens)
        if self.prefill_policy is None:
            self._schedule_decodes(draft)
            self._schedule_prefills(draft)
        else:
            self._schedule_one_kind(draft)
        return draft.output(self.kv_cache_manager.take_copies())

    def _schedule_one_kind(self, draft: StepDraft) -> None:
        """A prefill-only or a decode-only step (the other kind if the first finds nothing)."""
        num_decodable = sum(1 for r in self.running if _is_decode(r))
        num_candidates = len(self.waiting) + len(self.running) - num_decodable
        prefill_first = self.prefill_policy.takes_prefill(num_decodable, num_candidates)
        for prefill in (prefill_first, not prefill_first):
            (self._schedule_prefills if prefill else self._schedule_decodes)(draft)
            if draft.scheduled:
                self.prefill_policy.record(prefill)
                return

    def _schedule_decodes(self, draft: StepDraft) -> None:
        """One token for each running request that has only its last token to compute (with
        its proposed tokens, when it speculates and they fit)."""
        proposals = self._proposals(draft)
        index = 0
        while index < len(self.running) and draft.budget > 0:
            request = self.running[index]
            if not _is_decode(request) or request.request_id in draft.scheduled:
                index += 1
                continue
            proposed = proposals.get(request.request_id, [])[:draft.budget - 1]
            if proposed and self.kv_cache_manager.allocate_slots(request, 1, num_lookahead=len(proposed)):
                draft.add(self._scheduled_request(request, 1, proposed))
                index += 1
                continue
            while not self.kv_cache_manager.allocate_slots(request, 1):
                victim_index = self._last_unscheduled_after(index, draft)
                if victim_index is None:  # it is the last admitted itself
                    self._preempt_at(index, draft)
                    break
                self._preempt_at(victim_index, draft)
            else:
                draft.add(self._scheduled_request(request, 1))
                index += 1

    def _proposals(self, draft: StepDraft) -> dict[str, list[int]]:
        """The proposed tokens of this step's decodes, asked for all of them at once: each
        within the budget's room beside its own token, and so that all of them plus the bonus
        token stay within the request's length. The loop that schedules the decodes cuts them
        to the room left when it reaches each one."""
        if self.speculator is None or draft.budget < 2:
            return {}
        return self.speculator.propose([
            (request, min(draft.budget - 1, self.max_num_tokens(request) - request.num_tokens - 1))
            for request in self.running if _is_decode(request) and request.request_id not in draft.scheduled])

    def _schedule_prefills(self, draft: StepDraft) -> None:
        """The next prompt chunks of running requests, then admissions."""
        index = 0
        while index < len(self.running) and draft.budget > 0:
            request = self.running[index]
            if not _is_decode(request) and request.request_id not in draft.scheduled:
                num_left = request.num_tokens - request.num_computed_tokens
                num_new = self._make_room(request, index, self._fit_images(request, min(num_left, draft.budget), draft),
                                          draft)
                if num_new:
                    draft.add(self._scheduled_request(request, num_new))
                else:
                    draft.blocked = True
            index += 1
        if not draft.preempted_ids and not draft.blocked:
            self._schedule_waiting(draft)

    def _fit_images(self, request: Request, num_tokens: int, draft: StepDraft, start: int | None = None) -> int:
        """`num_tokens` from `start` (default: the computed count) cut to the step's encoder budget:
        a chunk starts no image past it (encoder_budget.py)."""
        if not request.image_spans:
            return num_tokens
        return fit_images(request.image_spans, request.num_computed_tokens if start is None else start, num_tokens,
                          draft.encoder_rows, self.config.max_num_batched_tokens, self.config.whole_images)

    def _make_room(self, request: Request, index: int, num_wanted: int, draft: StepDraft) -> int:
        """Allocate for up to `num_wanted` tokens, preempting later-admitted requests not
        scheduled in this step; with none left, take the room there is. Returns the count."""
        manager = self.kv_cache_manager
        while True:
            room = (len(request.block_ids) + manager.num_free_blocks) * manager.block_size \
                - request.num_computed_tokens
            num_new = min(num_wanted, room)
            victim_index = None if num_new == num_wanted else self._last_unscheduled_after(index, draft)
            if victim_index is None:
                break
            self._preempt_at(victim_index, draft)
        if num_new < num_wanted and self.config.whole_images and request.image_spans:  # no chunk ends inside an image
            num_new = stop_outside_images(request.image_spans, request.num_computed_tokens, num_new)
        if num_new <= 0:
            return 0
        allocated = manager.allocate_slots(request, num_new)
        assert allocated, "the room was measured just now"
        return num_new

    def _last_unscheduled_after(self, index: int, draft: StepDraft) -> int | None:
        """The running request admitted last after running[index] and not scheduled now."""
        for victim_index in range(len(self.running) - 1, index, -1):
            if self.running[victim_index].request_id not in draft.scheduled:
                return victim_index
        return None

    def _schedule_waiting(self, draft: StepDraft) -> None:
        manager = self.kv_cache_manager
        while self.waiting and draft.budget > 0 and len(self.running) < self.config.max_num_seqs:
            index = self._next_waiting()
            if index is None:
                break  # the head waits for an adapter slot and no base-model request is behind it
            request = self.waiting[index]
            computed_blocks = manager.get_computed_blocks(request)
            partial = manager.partial_hit(request, computed_blocks)  # (block, slots) copied after them
            if self.prefill_policy is not None and (len(computed_blocks) * manager.block_size
                                                    + (partial[1] if partial else 0)
                                                    >= max(request.num_prompt_tokens, request.num_tokens - 1)):
                # it would be a decode, admitted in a prefill step: recompute the partial hit, or a block
                if partial:
                    partial = None
                else:
                    computed_blocks.pop()
            num_cached = len(computed_blocks) * manager.block_size + (partial[1] if partial else 0)
            num_new_tokens = self._fit_images(request, min(request.num_tokens - num_cached, draft.budget), draft,
                                              num_cached)
            if not num_new_tokens or (num_new_tokens < request.num_tokens - num_cached
                                      and not self.config.chunk_prompts):
                break  # the whole prompt (or its next image) in one step, or wait for a step with room (FCFS)
            if not manager.allocate_slots(request, num_new_tokens, computed_blocks, partial=partial):
                break  # FCFS: nobody overtakes the head of the queue
            del self.waiting[index]
            request.num_computed_tokens = num_cached
            if manager.looks_up(request):
                draft.num_prefix_queried_tokens += request.num_tokens
                draft.num_prefix_hit_tokens += num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
            self.running.append(request)
            draft.add(self._scheduled_request(request, num_new_tokens))

    def _next_waiting(self) -> int | None:
        """The waiting request admitted next: the head (FCFS), unless LoRA's adapter limit holds
        it back (core/scheduling/adapters.py)."""
        if self.adapter_limit is None:
            return 0
        return self.adapter_limit.next_admissible(self.waiting, self.running)

    def _scheduled_request(self, request: Request, num_new_tokens: int, proposed: list[int] = ()
                           ) -> ScheduledRequest:
        start = request.num_computed_tokens
        stop = start + num_new_tokens
        assert 0 < num_new_tokens and stop <= request.num_tokens <= request.max_num_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(request.token_slice(start, stop)) + tuple(proposed),
            num_draft_tokens=len(proposed),
            num_computed_tokens=start,
            block_ids=tuple(request.block_ids),
            samples=stop == request.num_tokens and request.pooling is None,
            pools=request.pooling is not None,
            lora_name=request.lora_name,
            computes_prompt_logprobs=(request.sampling_params.prompt_logprobs is not None
                                      and not request.output_token_ids
                                      and start < request.num_prompt_tokens - 1),
            images=spans_in(request.image_spans, start, stop) if request.image_spans else (),
            position_shift=position_shift(request.image_spans, start) if request.image_spans else 0,
        )

    def _preempt_at(self, index: int, draft: StepDraft) -> None:
        victim = self.running.pop(index)
        assert victim.request_id not in draft.scheduled
        self._preempt(victim)
        draft.preempted_ids.append(victim.request_id)

    def _preempt(self, request: Request) -> None:
        """Drop the request's KV and queue it first; it is recomputed (prompt + outputs) later,
        from its blocks still in the prefix cache."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, int | list[int]]
               ) -> list[Request]:
        """Advance the computed counts, append sampled tokens; return the requests finished now.

        A request that verified proposals gets a list: the accepted proposals and the token
        after them (core/spec/acceptance.py). Its tokens are appended one at a time and the
        first that finishes it ends the run, so a stop inside it is decided as without speculation."""
        self._awaiting_update = False
        self.kv_cache_manager.confirm()
        finished: list[Request] = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished or preempted since the step was scheduled
            if request.num_computed_tokens != scheduled.num_computed_tokens:
                raise RuntimeError(f"request {request.request_id!r} was updated twice for one step")
            if not scheduled.samples:
                request.num_computed_tokens += scheduled.num_new_tokens
                if scheduled.pools and request.num_computed_tokens == request.num_prompt_tokens:
                    self._finish(request, FinishReason.POOLED)  # its embedding is pooled: nothing follows
                    finished.append(request)
                continue
            if scheduled.request_id not in sampled_token_ids:
                raise KeyError(f"no sampled token for request {scheduled.request_id!r}")
            token_ids = sampled_token_ids[scheduled.request_id]
            if isinstance(token_ids, int):
                token_ids = (token_ids,)
            num_accepted = len(token_ids) - 1
            if not 0 <= num_accepted <= scheduled.num_draft_tokens:
                raise ValueError(f"request {scheduled.request_id!r}: {len(token_ids)} tokens for "
                                 f"{scheduled.num_draft_tokens} proposals")
            request.num_computed_tokens += scheduled.num_new_tokens - scheduled.num_draft_tokens + num_accepted
            if scheduled.num_draft_tokens:
                self.speculator.record(request.request_id, scheduled.num_draft_tokens, num_accepted)
            for token_id in token_ids:
                request.output_token_ids.append(token_id)
                reason = self._check_stop(request, token_id)
                if reason is not None:
                    self._finish(request, reason)
                    finished.append(request)
                    break
            else:
                if scheduled.num_draft_tokens:
                    self.kv_cache_manager.settle_speculation(request, scheduled.seq_len - scheduled.num_draft_tokens)
        return finished

    def _check_stop(self, request: Request, token_id: int) -> FinishReason | None:
        """The token-level checks (EOS, stop token, length), combined by decide_finish."""
        params = request.sampling_params
        eos = stop_token = None
        if len(request.output_token_ids) >= params.min_tokens:
            eos = FinishReason.EOS if not params.ignore_eos and token_id in request.eos_token_ids else None
            stop_token = FinishReason.STOP_TOKEN if token_id in params.stop_token_ids else None
        length = FinishReason.LENGTH if request.num_tokens >= self.max_num_tokens(request) else None
        return decide_finish(eos, stop_token, length)

    def max_num_tokens(self, request: Request) -> int:
        """The most tokens the request may hold: its own limit, capped by the KV capacity."""
        return min(request.max_num_tokens, self.kv_cache_manager.capacity_tokens)

    # ---- between steps -------------------------------------------------------------

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish a waiting or running request and free its blocks.

        Returns the request, or None if it is unknown or already finished (idempotent).
        """
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, reason)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, FinishReason.ABORT)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished ones are forgotten)."""
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


def _is_decode(request: Request) -> bool:
    """Its prompt is computed and one token is left: the newest, generated one."""
    return request.num_tokens - request.num_computed_tokens == 1 and request.num_computed_tokens >= \
        request.num_prompt_tokens
