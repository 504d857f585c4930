"""Engine outputs as the Responses API shows them: a `response` object whose `output`
holds a `reasoning` item (a reasoning model's thinking, as `reasoning_text` content), then a
`message` item (`output_text` content) or `function_call` items.

The tool machinery is the chat route's (tool_output.py): a chat message or chat
stream deltas are read and re-shaped into Responses items here, so a call is
recognised the same way on both routes. A sequence cut off by the length limit
makes the response `incomplete` (reason `max_output_tokens`)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from switchyard.core.scheduling.request import FinishReason

from .reasoning import reasoning_of
from .responses_request import ResponsesRequest
from .tools import ToolPlan


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseFrame:
    """What every state of one response carries: ids, the echo of the request, usage."""

    req: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "max_output_tokens": req.max_output_tokens, "previous_response_id": None,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [_echo_tool(t) for t in req.tools or ()], "text": {"format": fmt},
            "truncation": "disabled", "store": False, "background": False, "reasoning": None,
            "service_tier": "default", "usage": usage, "user": req.user,
        }


def _echo_tool(tool: dict) -> dict:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict", True)}


def status_of(reason: FinishReason | None) -> str:
    """`incomplete` when cut off by max_output_tokens or the context, else `completed`."""
    return "incomplete" if reason is FinishReason.LENGTH else "completed"


def responses_usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A reasoning model's thinking: its text as `reasoning_text` content (vLLM's shape), no summary."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [reasoning_part(text)] if status != "in_progress" else []}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def message_item(item_id: str, text: str, status: str, logprobs: list | None) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)] if status != "in_progress" else []}


def text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict, status: str, logprobs: list | None, tools: ToolPlan | None) -> list[dict]:
    """A chat message (reasoning.reasoned_message) as Responses output items."""
    reasoning = reasoning_of(message)
    items = [reasoning_item(new_id("rs"), reasoning, status)] if reasoning else []
    calls = message.get("tool_calls")
    if calls:
        if message.get("content"):  # the text a model wrote before its calls (a tool-call parser's)
            items.append(message_item(new_id("msg"), message["content"], status, logprobs))
        return items + [function_call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                           status) for c in calls]
    if message.get("content") is None:  # a required call cut off before its name: nothing to show
        return items
    if items and not message["content"]:  # all thinking (cut off before the answer)
        return items
    return items + [message_item(new_id("msg"), message["content"], status, logprobs)]
