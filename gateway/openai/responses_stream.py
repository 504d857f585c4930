"""The Responses API's typed stream events, as the openai SDK's
`client.responses.create(stream=True)` and `client.responses.stream(...)` read them:

    response.created, response.in_progress
    per output item: response.output_item.added, then
      reasoning:      response.content_part.added, response.reasoning_text.delta...,
                      response.reasoning_text.done, response.content_part.done
      message:        response.content_part.added, response.output_text.delta...,
                      response.output_text.done, response.content_part.done
      function_call:  response.function_call_arguments.delta..., ...arguments.done
    response.output_item.done
    response.completed (or response.incomplete when cut off by max_output_tokens)

Every event carries `type` and a `sequence_number`. The thinking, text and tool-call
deltas come from the chat route's `ReasonedDeltas`, re-shaped into items here."""
from __future__ import annotations

from switchyard.core.scheduling.request import RequestOutput

from ..errors import GatewayError
from ..pipeline import StreamRenderer
from ..streaming import sse_event
from ..tokens import TokenStrings
from .common import openai_finish_reason
from .logprobs import chat_logprob_entries
from ..reasoning import ReasoningPlan
from .reasoning import ReasonedDeltas, reasoning_of
from .responses_output import (ResponseFrame, function_call_item, message_item, new_id, reasoning_item,
                               reasoning_part, responses_usage, status_of, text_part)
from .tools import ToolPlan


class ResponseEvents(StreamRenderer):
    def __init__(self, frame: ResponseFrame, tools: ToolPlan | None, strings: TokenStrings, want_logprobs: bool,
                 reasoning: ReasoningPlan | None = None):
        self._frame = frame
        self._strings = strings
        self._want_logprobs = want_logprobs
        self._deltas = ReasonedDeltas(reasoning, tools)
        self._sequence_number = 0
        self._items: list[dict] = []  # closed items, in output order
        self._open: dict | None = None  # the item being streamed
        self._text: list[str] = []
        self._logprobs: list = []
        self._status = "in_progress"
        self._usage: dict | None = None

    def head(self) -> list[str]:
        response = self._frame.body("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def on_output(self, index: int, out: RequestOutput) -> list[str]:
        events = []
        entries = None
        if self._want_logprobs and out.new_token_ids:
            entries = chat_logprob_entries(self._strings, out.new_token_ids, out.logprobs or (), out.top_logprobs)
        pairs = self._deltas.feed(out.new_text, out.new_token_ids, entries)
        if out.finished:
            pairs += self._deltas.finish(openai_finish_reason(out.finish_reason))[0]
            self._status = status_of(out.finish_reason)
            self._usage = responses_usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens,
                                          self._deltas.num_reasoning_tokens)
        for delta, logprobs in pairs:
            events += self._on_delta(delta, logprobs)
        if out.finished:
            events += self._close()
        return events

    def tail(self) -> list[str]:
        body = self._frame.body(self._status, self._items, self._usage)
        return [self._event(f"response.{self._status}", response=body)]

    def on_error(self, error: GatewayError) -> list[str]:
        failed = self._frame.body("failed", self._items, self._usage)
        failed["error"] = {"code": "server_error", "message": error.message}
        return [self._event("error", code=error.kind.name.lower(), message=error.message, param=error.param),
                self._event("response.failed", response=failed)]

    # -- items ---------------------------------------------------------------------------------
    def _on_delta(self, delta: dict, logprobs: list | None) -> list[str]:
        thinking = reasoning_of(delta)
        if thinking is not None:
            events = [] if self._open is not None and self._open["type"] == "reasoning" else self._open_reasoning()
            self._text.append(thinking)
            return events + [self._event("response.reasoning_text.delta", item_id=self._open["id"],
                                         output_index=len(self._items), content_index=0, delta=thinking)]
        if "content" in delta:
            events = [] if self._open is not None and self._open["type"] == "message" else self._open_message()
            self._text.append(delta["content"])
            self._logprobs += logprobs or []
            return events + [self._event("response.output_text.delta", item_id=self._open["id"],
                                         output_index=len(self._items), content_index=0,
                                         delta=delta["content"], logprobs=logprobs or [])]
        call = delta["tool_calls"][0]
        events = []
        if "id" in call:  # a call's first delta: its id and name
            events += self._close()
            self._open = function_call_item(new_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
            events.append(self._event("response.output_item.added", output_index=len(self._items),
                                      item=dict(self._open)))
        piece = call["function"].get("arguments") or ""
        if piece:
            self._open["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                      output_index=len(self._items), delta=piece))
        return events

    def _open_message(self) -> list[str]:
        events = self._close()
        self._open = message_item(new_id("msg"), "", "in_progress", None)
        self._text, self._logprobs = [], []
        where = {"item_id": self._open["id"], "output_index": len(self._items), "content_index": 0}
        return events + [self._event("response.output_item.added", output_index=len(self._items),
                                     item=dict(self._open)),
                         self._event("response.content_part.added", part=text_part("", None), **where)]

    def _open_reasoning(self) -> list[str]:
        events = self._close()
        self._open = reasoning_item(new_id("rs"), "", "in_progress")
        self._text = []
        where = {"item_id": self._open["id"], "output_index": len(self._items), "content_index": 0}
        return events + [self._event("response.output_item.added", output_index=len(self._items),
                                     item=dict(self._open)),
                         self._event("response.content_part.added", part=reasoning_part(""), **where)]

    def _close(self) -> list[str]:
        """Events that end the open item, which joins the output."""
        item, self._open = self._open, None
        if item is None:
            return []
        status = "incomplete" if self._status == "incomplete" else "completed"
        index = len(self._items)
        events = []
        if item["type"] == "message":
            text = "".join(self._text)
            item = message_item(item["id"], text, status, self._logprobs)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events += [self._event("response.output_text.done", text=text, logprobs=self._logprobs, **where),
                       self._event("response.content_part.done", part=item["content"][0], **where)]
        elif item["type"] == "reasoning":
            text = "".join(self._text)
            item = reasoning_item(item["id"], text, status)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events += [self._event("response.reasoning_text.done", text=text, **where),
                       self._event("response.content_part.done", part=item["content"][0], **where)]
        else:
            item = {**item, "status": status}
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        self._items.append(item)
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return sse_event(kind, payload)
