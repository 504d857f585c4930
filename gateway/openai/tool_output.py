"""A chat choice's output as OpenAI shows it: text, or tool calls (ids `call_...`,
arguments as a JSON string, `content` null, finish_reason `tool_calls`, or `stop` for
a named tool_choice as OpenAI's API answers); whole, or
as stream deltas that the OpenAI SDK, LangChain and LlamaIndex accumulate: a list
of calls with `index`, id, type and name in the first delta of each call only, the
arguments after it, in pieces as they are generated (named and required choices,
whose grammars fix the shape; an `auto` answer is read when it is complete).

The deprecated `functions` get `function_call` instead (one call, no id).

A plan with a tool-call parser (the model's own format, gateway/tool_parsers) is read by
it instead, in every mode: its text before a call is `content` (as vLLM answers), its calls
stream as they are generated (`parse_output` / `CallStream` decide what is a call)."""
from __future__ import annotations

import uuid

from ..tool_parsers import CallStream, parse_output
from .call_scanner import CallScanner, scanned_calls
from .tools import ParsedCall, ToolPlan, parse_calls

# first characters of an answer that may be a tool call (JSON, <tool_call>, a fence)
_CALL_STARTS = "{[<`"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def assistant_message(text: str, finish_reason: str, tools: ToolPlan | None) -> tuple[dict, str]:
    """The whole message of a choice, and its finish_reason."""
    if _parsed(tools):
        return _parsed_message(text, finish_reason, tools)
    calls = _calls(tools, text) if tools is not None and tools.calls else None
    if not calls:
        content = None if _cut_off_call(tools, finish_reason) else text
        return {"role": "assistant", "content": content, "refusal": None}, finish_reason
    message: dict = {"role": "assistant", "content": None, "refusal": None}
    if tools.legacy:
        message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
    else:
        message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, _calls_finish_reason(tools, finish_reason)


def _parsed(tools: ToolPlan | None) -> bool:
    """Whether a tool-call parser reads the output (the model's own format, and calls possible)."""
    return tools is not None and tools.calls and tools.parser is not None


def _parsed_message(text: str, finish_reason: str, tools: ToolPlan) -> tuple[dict, str]:
    """A whole output read by the plan's parser: its calls beside the text before them."""
    out = parse_output(tools.parser, text, tools.parallel, tools.hidden, cut_off=finish_reason == "length")
    if not out.calls:
        content = None if _cut_off_call(tools, finish_reason) else out.content
        return {"role": "assistant", "content": content, "refusal": None}, finish_reason
    message: dict = {"role": "assistant", "content": out.content, "refusal": None}
    if tools.legacy:
        message["function_call"] = {"name": out.calls[0].name, "arguments": out.calls[0].arguments}
    else:
        message["tool_calls"] = [{"id": c.call_id or new_call_id(), "type": "function",  # the model's own id (Kimi's)
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in out.calls]
    return message, _calls_finish_reason(tools, finish_reason)


def _calls(tools: ToolPlan, text: str) -> list[ParsedCall] | None:
    """The calls `text` holds; for `required`, whose grammar allows nothing but calls, an
    output cut off before its first call's name holds none and is no text either."""
    if tools.mode == "required":  # the grammar's shape, read as the stream reads it (even if cut short)
        return [ParsedCall(name, arguments) for name, arguments in scanned_calls(text)] or None
    return parse_calls(tools, text)


def _cut_off_call(tools: ToolPlan | None, finish_reason: str) -> bool:
    """A `required` output cut short before a whole call name: a JSON fragment, not an answer
    (so is a named call's, in a parser's format: its grammar allows nothing but the call)."""
    forced = ("required", "named") if tools is not None and tools.parser is not None else ("required",)
    return tools is not None and tools.mode in forced and finish_reason == "length"


def _calls_finish_reason(tools: ToolPlan, finish_reason: str) -> str:
    """The finish_reason of a choice that holds calls, decided here only. A named choice
    (`tool_choice` or `function_call` naming a function) ends with `stop`, as OpenAI's API
    answers when it forces the call; `auto` and `required` end with `tool_calls`
    (`function_call` for the deprecated `functions`). Clients read the calls from the
    message, not from this word (docs/api.md: Tool calls and finish_reason)."""
    if finish_reason == "length":  # cut short: the arguments may be incomplete
        return "length"
    if tools.mode == "named":
        return "stop"
    return "function_call" if tools.legacy else "tool_calls"


class ChoiceDeltas:
    """One streamed choice: `feed` each text delta (with its logprob entries), then
    `finish`. Each returns (delta, logprob entries) pairs. An `auto` answer is held
    back from its first character on if it may be a tool call, and sent as text
    after all if it is not one."""

    def __init__(self, tools: ToolPlan | None):
        self._tools = tools
        if tools is None or not tools.calls:
            self._mode = "text"
        elif tools.parser is not None:
            self._mode = "parsed"
            self._calls = CallStream(tools.parser, tools.parallel, tools.hidden)
        else:
            self._mode = {"named": "arguments", "required": "scanned"}.get(tools.mode, "undecided")
        self._scanner = CallScanner()
        self._num_sent_calls = 0
        self._held: list[str] = []
        self._held_logprobs: list | None = None
        self._started_call = False

    def feed(self, text: str, logprobs: list | None) -> list[tuple[dict, list | None]]:
        if self._mode == "parsed":
            return self._parsed_deltas(self._calls.feed(text), logprobs)
        if self._mode == "scanned":
            return self._scan(text, logprobs)
        if self._mode == "arguments":
            deltas = self._start_named_call()
            if text or logprobs:
                deltas.append((self._arguments_delta(0, text), logprobs))
            return deltas
        if self._mode != "text":
            self._hold(text, logprobs)
            if not self._is_text():
                return []
            text, logprobs = self._release()
        return [({"content": text}, logprobs)] if text or logprobs else []

    def finish(self, finish_reason: str) -> tuple[list[tuple[dict, list | None]], str]:
        if self._mode == "text":
            return [], finish_reason
        if self._mode == "parsed":
            events = self._calls.finish(cut_off=finish_reason == "length")
            if not self._calls.num_calls and _cut_off_call(self._tools, finish_reason):
                events = []  # a forced call cut short before its name: neither call nor text
            deltas = self._parsed_deltas(events, None)
            if self._calls.num_calls:
                return deltas, _calls_finish_reason(self._tools, finish_reason)
            return deltas, finish_reason
        if self._mode == "arguments":
            return self._start_named_call(), _calls_finish_reason(self._tools, finish_reason)
        text, logprobs = self._release()
        if self._mode == "scanned" and (self._num_sent_calls or _cut_off_call(self._tools, finish_reason)):
            return [], _calls_finish_reason(self._tools, finish_reason)
        calls = parse_calls(self._tools, text) if self._mode == "held" else None
        if not calls:
            return ([({"content": text}, logprobs)] if text else []), finish_reason
        deltas = []
        for i, call in enumerate(calls):
            deltas += [(self._header_delta(i, call.name), None), (self._arguments_delta(i, call.arguments), None)]
        deltas[-1] = (deltas[-1][0], logprobs)
        return deltas, _calls_finish_reason(self._tools, finish_reason)

    def _is_text(self) -> bool:
        """`auto`: whether the answer held so far is text; decided at its first
        non-space character (one that may start a call holds the rest back)."""
        if self._mode == "undecided":
            head = "".join(self._held).lstrip()
            if head:
                self._mode = "held" if head[0] in _CALL_STARTS else "text"
        return self._mode == "text"

    def _scan(self, text: str, logprobs: list | None) -> list[tuple[dict, list | None]]:
        """`required`: calls are sent as the grammar-shaped output is read; the text is
        kept until a call starts, for an output that holds none (no grammar applied)."""
        events = self._scanner.feed(text)
        if not self._num_sent_calls and not events:
            self._hold(text, logprobs)
            return []
        self._held, self._held_logprobs = [], None
        deltas = []
        for kind, value in events:
            if kind == "call":
                self._num_sent_calls += 1
                deltas.append((self._header_delta(self._num_sent_calls - 1, value), None))
            elif self._num_sent_calls:
                deltas.append((self._arguments_delta(self._num_sent_calls - 1, value), None))
        if deltas:
            deltas[-1] = (deltas[-1][0], logprobs)
        return deltas

    def _parsed_deltas(self, events: list, logprobs: list | None) -> list[tuple[dict, list | None]]:
        """A parser's events as deltas; log-probabilities held until a delta carries them."""
        if logprobs is not None:
            self._held_logprobs = (self._held_logprobs or []) + list(logprobs)
        deltas = []
        for event in events:
            if event[0] == "content":
                deltas.append(({"content": event[1]}, None))
            elif event[0] == "call":
                deltas.append((self._header_delta(event[1], event[2], self._calls.call_id(event[1])), None))
            else:
                deltas.append((self._arguments_delta(event[1], event[2]), None))
        if deltas and self._held_logprobs is not None:
            deltas[-1] = (deltas[-1][0], self._held_logprobs)
            self._held_logprobs = None
        return deltas

    def _hold(self, text: str, logprobs: list | None) -> None:
        self._held.append(text)
        if logprobs is not None:
            self._held_logprobs = (self._held_logprobs or []) + list(logprobs)

    def _release(self) -> tuple[str, list | None]:
        text, logprobs = "".join(self._held), self._held_logprobs
        self._held, self._held_logprobs = [], None
        return text, logprobs

    def _start_named_call(self) -> list[tuple[dict, list | None]]:
        if self._started_call:
            return []
        self._started_call = True
        return [(self._header_delta(0, self._tools.named), None)]

    def _header_delta(self, index: int, name: str, call_id: str | None = None) -> dict:
        """A call's first delta; `call_id`: the id the model wrote (Kimi K2's), else a new one."""
        if self._tools.legacy:
            return {"function_call": {"name": name, "arguments": ""}}
        return {"tool_calls": [{"index": index, "id": call_id or new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments_delta(self, index: int, arguments: str) -> dict:
        if self._tools.legacy:
            return {"function_call": {"arguments": arguments}}
        return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


__all__ = ["ChoiceDeltas", "ParsedCall", "assistant_message", "new_call_id"]
