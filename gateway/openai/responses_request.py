"""The Responses API's request body, and its translation into the one chat plan.

`POST /v1/responses` asks what a chat completion asks, in other words: `input`
items instead of messages, flat function tools, `text.format` instead of
`response_format`, `max_output_tokens`. `chat_request` turns a body into the
`ChatCompletionRequest` that the chat parser (params.py, tools.py, formats.py,
messages.py) already understands, so both routes share one plan, one tool
machinery and one grammar path; `responses_error` renames the chat field an error
names back to the Responses field it came from. We are stateless: `store: true`,
`previous_response_id`, `background` and `conversation` are refused clearly.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from ..errors import DIALECT_PARAM, GatewayError, invalid, renamed_error
from .images import IMAGE_PART, ORIGIN
from .schemas import ChatCompletionRequest

_TEXT_PARTS = ("input_text", "output_text", "text")
_REASONING_PARTS = ("reasoning_text", "summary_text")


class ResponsesRequest(BaseModel):
    """What the openai SDK's `client.responses.create` sends (unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    # accepted: they only label, bill or cache the request
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None


def check_stateless(req: ResponsesRequest) -> None:
    """Refuse what would need responses kept between requests or run in the background."""
    if req.store:
        raise invalid("store is not supported: responses are not kept (send store: false)", "store")
    if req.previous_response_id is not None:
        raise invalid("previous_response_id is not supported: responses are not kept, so send the whole "
                      "conversation in `input`", "previous_response_id")
    if req.conversation is not None:
        raise invalid("conversation is not supported: conversations are not kept", "conversation")
    if req.background:
        raise invalid("background is not supported: responses are answered while the request is open", "background")
    if req.prompt is not None:
        raise invalid("prompt (stored prompt templates) is not supported", "prompt")
    if req.truncation not in (None, "disabled"):
        raise invalid("truncation 'auto' is not supported: an input past the context is refused", "truncation")
    if req.max_tool_calls is not None:
        raise invalid("max_tool_calls is not supported", "max_tool_calls")
    unknown = [name for name in req.include or () if name != "message.output_text.logprobs"]
    if unknown:
        raise invalid(f"include {unknown[0]!r} is not supported (only 'message.output_text.logprobs')", "include")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks the engine for the same output."""
    check_stateless(req)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + input_messages(
        req.input)
    logprobs = req.include is not None and "message.output_text.logprobs" in req.include
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
        "logprobs": logprobs or req.top_logprobs is not None, "top_logprobs": req.top_logprobs,
        "stream": bool(req.stream),
    }
    if req.tools is not None:
        body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None and req.text.get("format") is not None:
        body["response_format"] = _response_format(req.text["format"])
    if req.reasoning is not None and req.reasoning.get("effort") is not None:
        body["reasoning_effort"] = req.reasoning["effort"]
    try:
        return ChatCompletionRequest.model_validate(body)
    except PydanticValidationError as exc:  # a shape the checks above let through
        first = exc.errors()[0]
        raise invalid(f"invalid input: {first['msg']}", "input") from exc


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages: text or message items, function calls as the assistant's
    tool calls, their outputs as tool messages; a reasoning item's text as the thinking
    (`reasoning_content`) of the assistant turn that follows it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise invalid("input must not be empty", "input")
    messages: list[dict] = []
    thinking: list[str] = []  # reasoning items not yet given to an assistant turn
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            messages.append({"role": _role(item, where), "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not thinking:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(item.get("output"), where)})
        elif kind == "reasoning":
            thinking.append(_reasoning_text(item))
            continue
        else:
            raise invalid(f"input items of type {kind!r} are not supported (message, function_call, "
                          "function_call_output and reasoning are)", f"{where}.type")
        if thinking and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "\n".join(t for t in thinking if t)
            thinking = []
    return messages


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text: its `reasoning_text` content, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(part.get("text") or "" for part in parts
                   if isinstance(part, dict) and part.get("type") in _REASONING_PARTS)


def _role(item: dict, where: str) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise invalid(f"a message's role must be user, assistant, system or developer; got {role!r}",
                      f"{where}.role")
    return role


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise invalid(f"`{key}` must be a non-empty string", f"{where}.{key}")
    return value


def _text(content, where: str) -> str | list[dict]:
    """A message's content (or a tool's output) as text: a string or text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of parts", f"{where}.content")
    pieces = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            pieces.append(part.get("text") or "")
        elif kind == "refusal":
            pieces.append(part.get("refusal") or "")
        elif kind == "input_image":
            pieces.append(_image_part(part, f"{where}.content.{k}"))
        else:
            raise invalid(f"content parts of type {kind!r} are not supported: this model reads text only",
                          f"{where}.content")
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in pieces]


def _image_part(part: dict, where: str) -> dict:
    """An `input_image` part as the chat image part it asks for (images.py); by URL only."""
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise invalid("input_image needs image_url (an http(s) or data URL); file_id is not supported", where)
    return {"type": IMAGE_PART, IMAGE_PART: {"url": url, "detail": part.get("detail")}, ORIGIN: DIALECT_PARAM + where}


def _chat_tool(index: int, tool: dict) -> dict:
    """A flat Responses function tool -> the chat shape `{type, function: {...}}`."""
    if tool.get("type") != "function":
        raise invalid(f"only tools of type 'function' are supported, not {tool.get('type')!r}",
                      f"tools.{index}.type")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise invalid(f"tool_choice of type {choice.get('type')!r} is not supported: use 'none', 'auto', "
                  "'required' or {\"type\": \"function\", \"name\": ...}", "tool_choice")


def _response_format(fmt: dict) -> dict:
    """`text.format` -> chat's `response_format`."""
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise invalid(f"unknown text.format type {kind!r}: expected 'text', 'json_object' or 'json_schema'",
                  "text.format")


# chat field -> the Responses field it was translated from (the longest prefix wins)
_PARAMS = (
    (re.compile(r"^tools\.(\d+)\.function(?=\.|$)"), r"tools.\1"),
    (re.compile(r"^response_format(?=\.|$)"), "text.format"),
    (re.compile(r"^max_completion_tokens$|^max_tokens$"), "max_output_tokens"),
    (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
    (re.compile(r"^messages(\.\d+)?"), "input"),
)
_WORDS = (("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"))


def responses_error(error: GatewayError) -> GatewayError:
    """`error` with the Responses field names in place of the chat ones."""
    return renamed_error(error, _PARAMS, _WORDS)
