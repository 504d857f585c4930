"""Turns token-level engine outputs into text deltas; applies stop strings. A pooling request's
one output (its embedding, core/pooling) passes through: it has no text."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..scheduling.request import EngineCoreOutput, FinishReason, Request, RequestOutput, decide_finish
from ..text.tokenizer import IncrementalDetokenizer


class _RequestState:
    def __init__(self, request: Request, detokenizer: IncrementalDetokenizer | None):
        self.request = request
        self.detokenizer = detokenizer
        self.num_output_tokens = 0


class OutputProcessor:
    """One per engine client. `finish` is called with (request_id, reason) when a
    stop string ends a request, so the engine frees it before its next step."""

    def __init__(self, tokenizer, finish: Callable[[str, FinishReason], None]):
        self._tokenizer = tokenizer
        self._finish = finish
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request: Request) -> None:
        if request.pooling is not None:
            self._states[request.request_id] = _RequestState(request, None)
            return
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(self._tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                             params.stop, params.include_stop_str_in_output)
        self._states[request.request_id] = _RequestState(request, detokenizer)

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        results = []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:  # aborted while its step ran
                continue
            if state.detokenizer is None:  # a pooling request: its one output, finished
                del self._states[out.request_id]
                results.append(_pooled(state.request, out))
                continue
            text = state.detokenizer.update(out.new_token_ids, finished=out.finish_reason is not None)
            stop_string = FinishReason.STOP_STRING if state.detokenizer.stop_string_hit is not None else None
            finish_reason = decide_finish(out.finish_reason, stop_string)
            if out.finish_reason is None and finish_reason is not None:
                self._finish(out.request_id, finish_reason)  # the engine still holds it: free it now
            if stop_string is not None and state.detokenizer.num_read < len(out.new_token_ids):
                out = _truncated(out, state.detokenizer.num_read)  # tokens past the stop string: dropped
            state.num_output_tokens += len(out.new_token_ids)
            if finish_reason is not None:
                del self._states[out.request_id]
            results.append(RequestOutput(
                request_id=out.request_id, new_token_ids=out.new_token_ids, new_text=text,
                finished=finish_reason is not None, finish_reason=finish_reason,
                num_prompt_tokens=state.request.num_prompt_tokens, num_output_tokens=state.num_output_tokens,
                logprobs=out.logprobs, top_logprobs=out.top_logprobs,
                first_scheduled_time=state.request.first_scheduled_time,
                num_cached_tokens=state.request.num_cached_tokens,
                prompt_logprobs=out.prompt_logprobs, error=out.error))
        return results


def _pooled(request: Request, out: EngineCoreOutput) -> RequestOutput:
    return RequestOutput(request_id=out.request_id, new_token_ids=(), new_text="", finished=True,
                         finish_reason=out.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
                         num_output_tokens=0, first_scheduled_time=request.first_scheduled_time,
                         error=out.error, embedding=out.embedding)


def _truncated(out: EngineCoreOutput, num_tokens: int) -> EngineCoreOutput:
    """The first `num_tokens` of a step's tokens, with their log-probabilities."""
    return replace(out, new_token_ids=out.new_token_ids[:num_tokens],
                   logprobs=None if out.logprobs is None else out.logprobs[:num_tokens],
                   top_logprobs=None if out.top_logprobs is None else out.top_logprobs[:num_tokens])
