"""Anthropic's stream of server-sent events, as the anthropic SDK's `messages.stream`
and `messages.create(stream=True)` (and Claude Code) read them:

    message_start (the message, no content yet), ping
    per content block: content_block_start, content_block_delta...
                       (thinking_delta for a thinking block; text_delta; input_json_delta
                       for a tool_use's input), content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

An error once the stream has begun is one `error` event (errors.py), which ends it.
The thinking, text and tool-call deltas come from the chat route's `ReasonedDeltas`,
re-shaped into content blocks here."""
from __future__ import annotations

from switchyard.core.scheduling.request import RequestOutput

from ..errors import GatewayError
from ..openai.common import openai_finish_reason
from ..openai.reasoning import ReasonedDeltas, reasoning_of
from ..openai.tools import ToolPlan
from ..pipeline import StreamRenderer
from ..reasoning import ReasoningPlan
from ..streaming import sse_event
from .errors import error_event
from .output import MessageFrame, matched_stop_sequence, new_id, stop_reason, text_block, thinking_block, usage


class MessageEvents(StreamRenderer):
    def __init__(self, frame: MessageFrame, tools: ToolPlan | None, num_prompt_tokens: int, context_bound: bool,
                 stop_sequences: list[str], tokenizer, reasoning: ReasoningPlan | None = None):
        self._frame = frame
        self._deltas = ReasonedDeltas(reasoning, tools)
        self._num_prompt_tokens = num_prompt_tokens
        self._context_bound = context_bound
        self._stop_sequences = stop_sequences
        self._tokenizer = tokenizer
        self._token_ids: list[int] = []  # to tell which stop sequence ended the message
        self._num_blocks = 0
        self._open: str | None = None  # the type of the block being streamed
        self._tool_use = False

    def head(self) -> list[str]:
        # the cache is looked up when the prompt is scheduled: message_delta's usage splits the prompt
        start = self._frame.body([], None, None, usage(self._num_prompt_tokens, 0, 0))
        return [_event("message_start", message=start), _event("ping")]

    def on_output(self, index: int, out: RequestOutput) -> list[str]:
        if len(self._stop_sequences) > 1:
            self._token_ids += out.new_token_ids
        pairs = self._deltas.feed(out.new_text, out.new_token_ids, None)
        if out.finished:
            pairs += self._deltas.finish(openai_finish_reason(out.finish_reason))[0]
        events = [event for delta, _ in pairs for event in self._on_delta(delta)]
        if out.finished:
            events += self._close()
            reason = stop_reason(out.finish_reason, self._tool_use, self._context_bound)
            stop_sequence = None
            if reason == "stop_sequence":
                stop_sequence = matched_stop_sequence(self._stop_sequences, self._token_ids, self._tokenizer)
            events.append(_event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop_sequence},
                                 usage=usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)))
        return events

    def tail(self) -> list[str]:
        return [_event("message_stop")]

    def on_error(self, error: GatewayError) -> list[str]:
        return [error_event(error)]

    # -- content blocks ----------------------------------------------------------------------------
    def _on_delta(self, delta: dict) -> list[str]:
        thinking = reasoning_of(delta)
        if thinking is not None:
            events = [] if self._open == "thinking" else self._start("thinking", thinking_block(""))
            return events + [self._delta({"type": "thinking_delta", "thinking": thinking})]
        if "content" in delta:
            events = [] if self._open == "text" else self._start("text", text_block(""))
            return events + [self._delta({"type": "text_delta", "text": delta["content"]})]
        call = delta["tool_calls"][0]
        events = []
        if "id" in call:  # a call's first delta: its name
            self._tool_use = True
            block = {"type": "tool_use", "id": new_id("toolu"), "name": call["function"]["name"], "input": {}}
            events += self._start("tool_use", block)
        piece = call["function"].get("arguments") or ""
        if piece:
            events.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return events

    def _start(self, kind: str, block: dict) -> list[str]:
        events = self._close()
        self._open = kind
        return events + [_event("content_block_start", index=self._num_blocks, content_block=block)]

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", index=self._num_blocks, delta=delta)

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        self._num_blocks += 1
        return [_event("content_block_stop", index=self._num_blocks - 1)]


def _event(kind: str, **fields) -> str:
    return sse_event(kind, {"type": kind, **fields})
