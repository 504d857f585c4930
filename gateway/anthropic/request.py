"""Anthropic's request bodies, and their translation into the one chat plan.

`POST /v1/messages` asks what a chat completion asks, in other words: a top-level
`system`, messages of content blocks (`text`, `tool_use` in the assistant's turns,
`tool_result` in the user's), tools with an `input_schema`, `tool_choice` as `auto`,
`any`, `tool` or `none`, `stop_sequences`, `output_config.format` (a JSON schema the
answer must follow). `chat_request` turns a body into the `ChatCompletionRequest` the
chat parser (params.py, tools.py, formats.py, messages.py) already understands, so both
routes render one prompt and share one tool machinery and one grammar path;
`anthropic_error` renames the chat field an error names back to the Anthropic field
it came from.

Decisions made here, once:
- text blocks are joined with nothing between them (as chat content parts are), and
  Claude Code's per-request `x-anthropic-billing-header` system block is dropped (its
  hash changes every request and would defeat the prefix cache);
- a `tool_result` with `is_error: true` reaches the model as "Error: <its text>";
- `tool_choice` `auto` or `none` without tools means no tools (`any` and `tool` need them);
- `thinking` reaches the chat template as `enable_thinking` (true for `enabled` and
  `adaptive`, false for `disabled`: what Qwen3-style templates read) and `output_config.effort`
  as `reasoning_effort` (what gpt-oss's reads); a template that reads neither ignores them.
  `budget_tokens` (with `enabled`) is the thinking budget: once spent, the end of thinking is
  forced (core/grammar/gate.py; a model that does not reason ignores it, as it ignores
  `thinking`). A reasoning model's thinking comes back as `thinking`
  blocks (gateway/reasoning; output.py, stream.py); earlier `thinking` blocks in the
  assistant's turns reach the template as that turn's thinking (`reasoning_content`, which
  the template shows or drops), `redacted_thinking` ones are dropped; so is a top-level
  `cache_control` (the prefix cache needs no marks);
- `temperature`, `top_p` and `top_k` are read when sent (the SDK no longer has them as
  arguments: `extra_body`), as llama.cpp and vLLM read them;
- `image` blocks in user turns (base64 and url sources) become chat image parts
  (gateway/openai/images.py), read as the chat route reads them; an image elsewhere, documents,
  server tools, a final assistant message (prefill), MCP servers and containers are refused with a
  400 naming them.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from ..errors import DIALECT_PARAM, GatewayError, invalid, renamed_error
from ..openai.images import IMAGE_PART, ORIGIN
from ..openai.schemas import ChatCompletionRequest

_ROLES = ("user", "assistant")
_SKIPPED_BLOCKS = ("redacted_thinking",)  # encrypted thinking: nothing any model here can read
_THINKING_KWARG = {"enabled": True, "adaptive": True, "disabled": False}  # thinking.type -> enable_thinking
_NOT_TEXT = ("image", "document", "search_result")
_BILLING_HEADER = "x-anthropic-billing-header"
_CLIENT_TOOL_TYPES = (None, "custom")


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: what is rendered into the prompt (unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # -> the template's enable_thinking
    output_config: dict[str, Any] | None = None  # `format` a grammar, `effort` the template's reasoning_effort
    output_format: dict[str, Any] | None = None  # the beta's name of output_config.format
    # refused: they cannot be honoured here
    mcp_servers: list[Any] | None = None
    container: Any = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`: what the anthropic SDK's `messages.create` sends."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    # accepted: they only label or bill the request
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request whose prompt and sampling are this request's. Its
    `max_tokens` is left unset: the route fits the request's into the context itself."""
    _refuse_unsupported(req)
    body: dict[str, Any] = {"model": req.model, "messages": _system(req.system) + _conversation(req.messages)}
    if isinstance(req, MessagesRequest):
        body.update(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences,
                    stream=req.stream)
    if req.tools:  # an empty list is no tools
        body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None and (req.tools or req.tool_choice.get("type") not in ("auto", "none")):
        body["tool_choice"], parallel = _chat_tool_choice(req.tool_choice)
        body["parallel_tool_calls"] = parallel
    output_format = _output_format(req)
    if output_format is not None:
        body["response_format"] = output_format
    template_kwargs = _template_kwargs(req)
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    budget = (req.thinking or {}).get("budget_tokens")
    if isinstance(req, MessagesRequest) and budget is not None and (req.thinking or {}).get("type") == "enabled":
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise invalid(f"thinking.budget_tokens must be a non-negative integer, got {budget!r}",
                          "thinking.budget_tokens")
        body["thinking_token_budget"] = budget
    try:
        return ChatCompletionRequest.model_validate(body)
    except PydanticValidationError as exc:  # a shape the checks below let through
        raise invalid(f"invalid messages: {exc.errors()[0]['msg']}", "messages") from exc


def _template_kwargs(req: CountTokensRequest) -> dict[str, Any]:
    """`thinking` and `output_config.effort` as the chat template's variables."""
    kwargs: dict[str, Any] = {}
    kind = (req.thinking or {}).get("type")
    if kind is not None:
        if kind not in _THINKING_KWARG:
            raise invalid(f"thinking.type must be 'enabled', 'adaptive' or 'disabled', not {kind!r}", "thinking.type")
        kwargs["enable_thinking"] = _THINKING_KWARG[kind]
    effort = (req.output_config or {}).get("effort")
    if isinstance(effort, str):
        kwargs["reasoning_effort"] = effort
    return kwargs


def _refuse_unsupported(req: CountTokensRequest) -> None:
    if req.mcp_servers:
        raise invalid("mcp_servers is not supported: this server runs no MCP connector", "mcp_servers")
    if req.container is not None:
        raise invalid("container is not supported: this server runs no code execution", "container")


# -- messages -----------------------------------------------------------------------------------
def _system(system: str | list[dict] | None) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    pieces = []
    for i, block in enumerate(system):
        if _kind(block) != "text":
            raise invalid(f"system blocks must be text blocks, not {_kind(block)!r}", f"system.{i}.type")
        text = _string(block, "text", f"system.{i}", empty=True)
        if not text.startswith(_BILLING_HEADER):
            pieces.append(text)
    return [{"role": "system", "content": "".join(pieces)}] if pieces else []


def _conversation(messages: list[dict]) -> list[dict]:
    if not messages:
        raise invalid("messages must hold at least one message", "messages")
    chat: list[dict] = []
    for i, message in enumerate(messages):
        chat += _message(message, f"messages.{i}")
    if messages[-1].get("role") == "assistant":
        raise invalid("a final assistant message (prefill) is not supported: end with a user message",
                      f"messages.{len(messages) - 1}.role")
    return chat


def _message(message: dict, where: str) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results become tool
    messages (in order, around its text); an assistant turn's tool_use blocks its tool calls."""
    role = message.get("role")
    if role not in _ROLES:
        hint = " (send the system prompt as the top-level `system`)" if role == "system" else ""
        raise invalid(f"a message's role must be 'user' or 'assistant', not {role!r}{hint}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of content blocks", f"{where}.content")
    out: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    thinking: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _kind(block)
        if kind == "text":
            texts.append(_string(block, "text", at, empty=True))
        elif kind == "image" and role == "user":
            texts.append(_image_part(block, at))
        elif kind in _NOT_TEXT:
            raise invalid(f"{kind} blocks are not supported: this model reads text only, not images or "
                          "documents", f"{at}.type")
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            if texts:  # text before a result stays before it
                out.append({"role": "user", "content": _user_content(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                        "content": _tool_result_text(block, at)})
        elif kind == "thinking" and role == "assistant":
            thinking.append(_string(block, "thinking", at, empty=True))
        elif kind in _SKIPPED_BLOCKS and role == "assistant":
            continue
        else:
            raise invalid(f"content blocks of type {kind!r} are not supported in a {role} message", f"{at}.type")
    if role == "assistant":
        turn: dict = {"role": "assistant", "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        if any(thinking):
            turn["reasoning_content"] = "\n".join(t for t in thinking if t)
        return [turn]
    if texts or not out:
        out.append({"role": "user", "content": _user_content(texts)})
    return out


def _image_part(block: dict, where: str) -> dict:
    """An `image` block as the chat image part it asks for (gateway/openai/images.py), which
    remembers the block's place for errors. Sources: base64 (with its media_type) and url."""
    source = block.get("source")
    kind = _kind(source)
    if kind == "base64":
        media_type = _string(source, "media_type", f"{where}.source")
        url = f"data:{media_type};base64,{_string(source, 'data', f'{where}.source')}"
    elif kind == "url":
        url = _string(source, "url", f"{where}.source")
    else:
        raise invalid(f"image sources of type {kind!r} are not supported (base64 and url are)", f"{where}.source.type")
    return {"type": IMAGE_PART, IMAGE_PART: {"url": url}, ORIGIN: DIALECT_PARAM + where}


def _user_content(pieces: list) -> str | list[dict]:
    """A user turn's text, or its parts where it holds images (text runs joined, as text blocks are)."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)
    parts: list[dict] = []
    for piece in pieces:
        if not isinstance(piece, str):
            parts.append(piece)
        elif parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += piece
        else:
            parts.append({"type": "text", "text": piece})
    return parts


def _tool_call(block: dict, where: str) -> dict:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise invalid("a tool_use block's input must be an object", f"{where}.input")
    return {"id": _string(block, "id", where), "type": "function",
            "function": {"name": _string(block, "name", where), "arguments": arguments}}


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        pieces = []
        for k, part in enumerate(content):
            kind = _kind(part)
            if kind != "text":
                raise invalid(f"a tool_result may hold text blocks only, not {kind!r}: this model reads text only",
                              f"{where}.content.{k}.type")
            pieces.append(_string(part, "text", f"{where}.content.{k}", empty=True))
        text = "".join(pieces)
    else:
        raise invalid("a tool_result's content must be a string or a list of text blocks", f"{where}.content")
    return f"Error: {text}" if block.get("is_error") else text


def _kind(block) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


def _string(block: dict, key: str, where: str, empty: bool = False) -> str:
    value = block.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise invalid(f"`{key}` must be a {'' if empty else 'non-empty '}string", f"{where}.{key}")
    return value


def _output_format(req: CountTokensRequest) -> dict | None:
    """`output_config.format` (or the beta's `output_format`): `{"type": "json_schema", "schema"}`
    -> chat's `response_format`, whose grammar holds the answer to the schema."""
    config_format = (req.output_config or {}).get("format")
    if config_format is not None and req.output_format is not None:
        raise invalid("send output_config.format or output_format, not both", "output_format")
    fmt = config_format if config_format is not None else req.output_format
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise invalid("the output format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                      "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


# -- tools ------------------------------------------------------------------------------------------
def _chat_tool(index: int, tool: dict) -> dict:
    """A client tool `{name, description?, input_schema}` -> the chat shape `{type, function}`."""
    where = f"tools.{index}"
    if not isinstance(tool, dict):
        raise invalid("each tool must be an object", where)
    if tool.get("type") not in _CLIENT_TOOL_TYPES:
        raise invalid(f"tools of type {tool.get('type')!r} (Anthropic's server tools) are not supported: "
                      "only client tools {name, description, input_schema}", f"{where}.type")
    if "input_schema" not in tool:
        raise invalid("a tool needs `input_schema`, the JSON schema of its input", f"{where}.input_schema")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _chat_tool_choice(choice: dict) -> tuple[str | dict, bool | None]:
    """(chat's tool_choice, parallel_tool_calls): `any` is `required`, `tool` a named choice."""
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in _CHOICES:
        return _CHOICES[kind], parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise invalid("tool_choice of type 'tool' needs the tool's `name`", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise invalid(f"tool_choice type must be 'auto', 'any', 'tool' or 'none', not {kind!r}", "tool_choice.type")


# -- errors ------------------------------------------------------------------------------------------
# chat field -> the Anthropic field it was translated from (the first match wins)
_PARAMS = (
    (re.compile(r"^tools\.(\d+)\.function\.parameters(?=\.|$)"), r"tools.\1.input_schema"),
    (re.compile(r"^tools\.(\d+)\.function(?=\.|$)"), r"tools.\1"),
    (re.compile(r"^stop$"), "stop_sequences"),
    (re.compile(r"^max_completion_tokens$"), "max_tokens"),
    (re.compile(r"^thinking_token_budget$"), "thinking.budget_tokens"),
    (re.compile(r"^response_format(?=\.|$)"), "output_config.format"),
    (re.compile(r"^messages\.\d+.*$"), "messages"),  # chat's message indices are not the request's
)
_WORDS = (("max_completion_tokens", "max_tokens"), ("thinking_token_budget", "thinking.budget_tokens"), ("stop supports", "stop_sequences supports"),
          ("response_format", "output_config.format"), ("tool_choice 'required'", "tool_choice 'any'"),
          ("tool_choice 'named'", "tool_choice 'tool'"))


def anthropic_error(error: GatewayError) -> GatewayError:
    """`error` with the Anthropic field names in place of the chat ones."""
    return renamed_error(error, _PARAMS, _WORDS)
