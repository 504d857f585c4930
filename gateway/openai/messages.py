"""Chat messages -> the chat template's input, and the rendered prompt's token ids.

A reasoning model's template (gateway/reasoning) also gets the request's `reasoning_effort`
and each earlier assistant turn's thinking apart from its answer (reasoning/history.py)."""
from __future__ import annotations

import json

from ..errors import invalid
from ..reasoning import served_format
from ..reasoning.history import separated
from ..tool_parsers import served_tool_format
from .images import ORIGIN, as_parts, has_images, template_parts
from .schemas import ChatCompletionRequest, ChatMessage, ContentPart
from .tool_prompt import ToolRendering
from .tools import ToolPlan

_TEXT_PARTS = ("text", "input_text", "refusal")
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template",
                             "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
                             "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"}


def template_messages(messages: list[ChatMessage], vision: bool = False) -> list[dict]:
    """Messages as chat templates expect them: string content, `developer` as `system`,
    the deprecated `function` role as `tool`, tool calls with parsed arguments. `vision`: the
    model reads images, and a message with image parts keeps them as parts (images.py)."""
    if not messages:
        raise invalid("messages must not be empty", "messages")
    return [_template_message(i, m, vision) for i, m in enumerate(messages)]


def _template_message(index: int, message: ChatMessage, vision: bool = False) -> dict:
    param = f"messages.{index}"
    if message.audio is not None or message.function_call is not None:
        raise invalid("audio and function_call in messages are not supported", param)
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    content = template_parts(message.content, lambda p: _content_text([p], param)) \
        if vision and has_images(message.content) else _content_text(message.content, param)
    out: dict = {"role": role, "content": content}
    if message.refusal and not out["content"]:
        out["content"] = message.refusal
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": _arguments(call.function.arguments, param)}}
                             for call in message.tool_calls]
    return out


def _content_text(content: str | list[ContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    pieces = []
    for part in content:
        if part.type not in _TEXT_PARTS:
            origin = (part.model_extra or {}).get(ORIGIN)  # a Responses or Anthropic part: its own place
            raise invalid(f"content parts of type {part.type!r} are not supported: this model reads text only "
                          "(no images)", origin or f"{param}.content")
        pieces.append(part.text if part.type != "refusal" else part.refusal or "")
    return "".join(p or "" for p in pieces)


def takes_images(service) -> bool:
    """Whether the served model reads images (the engine says so, EngineInfo.image_token)."""
    info = service.client.info
    return info is not None and info.image_token is not None


def _arguments(arguments: str | dict, param: str) -> dict:
    """Templates expect tool-call arguments as a mapping; OpenAI sends a JSON string."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise invalid(f"tool call arguments are not valid JSON: {exc}", f"{param}.tool_calls") from exc
    return parsed if isinstance(parsed, dict) else {"value": parsed}


def chat_prompt_ids(service, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> list[int]:
    """The rendered conversation, tokenized (the template adds the special tokens)."""
    return chat_prompt(service, req, tools)[1]


def chat_prompt(service, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids."""
    text = chat_prompt_text(service, req, tools)
    return text, service.encode(text, add_special_tokens=False)


def chat_prompt_text(service, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> str:
    """The chat template applied to the request's messages. Tools, tool calls and tool
    results go through the template when it knows them; otherwise `ToolRendering`
    writes them into the messages as text."""
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    reasoning = served_format(service)
    _reasoning_effort(req.reasoning_effort, reasoning is not None, kwargs)
    rendering = ToolRendering.for_template(getattr(service.tokenizer, "chat_template", None),
                                           served_tool_format(service))
    vision = takes_images(service)
    messages = rendering.messages(separated(reasoning, template_messages(req.messages, vision)), tools,
                                  req.tool_prompt)
    if vision:
        messages = as_parts(messages)
    if tools is not None and rendering.template_renders_tools:
        kwargs["tools"] = tools.definitions()
    return service.render_chat(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)


def _reasoning_effort(effort: str | None, reasons: bool, kwargs: dict) -> None:
    """`reasoning_effort` (a word params.py checked) reaches a reasoning model's template
    (gpt-oss's reads it, as vLLM passes it); a model that does not reason refuses any effort
    but "none"."""
    if effort is None:
        return
    if not reasons:
        if effort != "none":
            raise invalid("reasoning_effort is not supported: this model does not reason (no reasoning parser: "
                          "see --reasoning-parser)", "reasoning_effort")
        return
    kwargs.setdefault("reasoning_effort", effort)
