"""Continuous batching with vLLM v1's token catch-up policy. Pure Python, no torch.

Every request has `num_tokens` (prompt + outputs) and `num_computed_tokens`; each
step hands out tokens so that the computed count catches up: one token for a
decode, a chunk of the prompt for a prefill, all within one token budget.

The engine calls `schedule()`, runs the model, samples, then calls `update()`, all
on one thread; aborts and stop strings go through `finish_request()` between steps.
"""
from __future__ import annotations

import time

from collections import deque

from .config import SchedulerConfig
from .kv.kv_cache_manager import KVCacheManager
from .params import ValidationError
from .request import FinishReason, Request, RequestStatus
from .scheduler_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go back to the front
        self.running: list[Request] = []  # in admission order; the last is preempted first
        self.num_preemptions = 0  # over the scheduler's life, for metrics and tests
        # Backends that cannot mix prefill and decode (config.mixed_prefill_decode=False)
        # still get mixed steps: that policy (TGI's waiting-served ratio) is not built yet.

    # ---- admission -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValidationError if it can never produce a token."""
        if request.request_id in self.requests:
            raise ValidationError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValidationError("the prompt must contain at least one token", "prompt")
        if request.num_prompt_tokens + 1 > request.max_model_len:
            raise ValidationError(
                f"the prompt has {request.num_prompt_tokens} tokens; with one generated token that "
                f"exceeds the context length of {request.max_model_len} tokens", "prompt")
        if not self.kv_cache_manager.can_ever_fit(request.num_prompt_tokens + 1):
            raise ValidationError(
                f"the prompt has {request.num_prompt_tokens} tokens; with one generated token that "
                f"exceeds the KV cache capacity of {self.kv_cache_manager.capacity_tokens} tokens", "prompt")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # ---- one step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled, preempted_ids, budget = self._schedule_running(budget)
        # A step that had to preempt admits nobody: the pool is too tight already.
        if not preempted_ids:
            scheduled += self._schedule_waiting(budget)
        # Decodes (one new token) first, then longer chunks; stable within each group.
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return SchedulerOutput(scheduled=tuple(scheduled), preempted_ids=tuple(preempted_ids))

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledRequest], list[str], int]:
        scheduled: list[ScheduledRequest] = []
        preempted_ids: list[str] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache_manager.allocate_slots(request, num_new_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is request:
                    return scheduled, preempted_ids, budget
            scheduled.append(self._scheduled_request(request, num_new_tokens))
            budget -= num_new_tokens
            index += 1
        return scheduled, preempted_ids, budget

    def _schedule_waiting(self, budget: int) -> list[ScheduledRequest]:
        scheduled: list[ScheduledRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv_cache_manager.allocate_slots(request, num_new_tokens):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            scheduled.append(self._scheduled_request(request, num_new_tokens))
            budget -= num_new_tokens
        return scheduled

    def _scheduled_request(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        stop = start + num_new_tokens
        assert 0 < num_new_tokens and stop <= request.num_tokens <= request.max_num_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=_token_slice(request, start, stop),
            num_computed_tokens=start,
            block_ids=tuple(request.block_ids),
            samples=stop == request.num_tokens,
            computes_prompt_logprobs=(request.sampling_params.prompt_logprobs is not None
                                      and not request.output_token_ids
                                      and start < request.num_prompt_tokens - 1),
        )

    def _preempt(self, request: Request) -> None:
        """Drop the request's KV and queue it first; it is recomputed (prompt + outputs) later."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Advance the computed counts, append sampled tokens; return the requests finished now."""
        finished: list[Request] = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished or preempted since the step was scheduled
            if request.num_computed_tokens != scheduled.num_computed_tokens:
                raise RuntimeError(f"request {request.request_id!r} was updated twice for one step")
            request.num_computed_tokens += scheduled.num_new_tokens
            if not scheduled.samples:
                continue
            if scheduled.request_id not in sampled_token_ids:
                raise KeyError(f"no sampled token for request {scheduled.request_id!r}")
            token_id = sampled_token_ids[scheduled.request_id]
            request.output_token_ids.append(token_id)
            reason = self._check_stop(request, token_id)
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return FinishReason.EOS
            if token_id in params.stop_token_ids:
                return FinishReason.STOP_TOKEN
        if request.num_tokens >= self.max_num_tokens(request):
            return FinishReason.LENGTH
        return None

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


def _token_slice(request: Request, start: int, stop: int) -> tuple[int, ...]:
    """request.all_token_ids[start:stop] without concatenating the whole list."""
    prompt, outputs = request.prompt_token_ids, request.output_token_ids
    num_prompt = len(prompt)
    if start >= num_prompt:
        return tuple(outputs[start - num_prompt:stop - num_prompt])
    if stop <= num_prompt:
        return tuple(prompt[start:stop])
    return tuple(prompt[start:]) + tuple(outputs[:stop - num_prompt])
