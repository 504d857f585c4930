"""Tools in the prompt, for chat templates that do not render them (SmolLM2's renders
only `role` and `content`): the tool definitions and the expected answer format go
into the system message (as TGI's `tool_prompt` does), an assistant's earlier tool
calls become the JSON text it would have written, and a tool's result says which
function it came from.

A model served with a tool-call format (gateway/tool_parsers) is told that format, its
earlier calls are written in it, and the conversation is given as its template expects
(Mistral's: tool call ids of 9 characters) whether or not the request has tools."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..tool_parsers import ToolCall, ToolFormat, ToolParser
from .tools import ToolPlan

DEFAULT_TOOL_PROMPT = "You can call these functions:"
_CALL = '{"name": <function name>, "arguments": <arguments object>}'


@dataclass(frozen=True)
class ToolRendering:
    template_renders_tools: bool  # the template reads `tools`
    template_renders_calls: bool  # the template reads assistant `tool_calls`
    format: ToolFormat | None = None  # the served model's tool-call format, if any

    @classmethod
    def for_template(cls, template, tool_format: ToolFormat | None = None) -> ToolRendering:
        text = template if isinstance(template, str) else json.dumps(template or "")
        return cls("tools" in text, "tool_calls" in text, tool_format)

    def messages(self, messages: list[dict], tools: ToolPlan | None, tool_prompt: str | None) -> list[dict]:
        parser = self.format.for_tools(()) if self.format is not None else None
        if parser is not None:
            messages = parser.prepare_messages(messages)
        if not self.template_renders_calls:
            messages = _calls_as_text(messages, parser)
        if tools is not None and tools.calls and not self.template_renders_tools:
            messages = _with_system_text(messages, instructions(tools, tool_prompt))
        return messages


def instructions(tools: ToolPlan, tool_prompt: str | None = None) -> str:
    lines = [tool_prompt.strip() if tool_prompt else DEFAULT_TOOL_PROMPT]
    for tool in tools.tools:
        definition = {"name": tool.name, "parameters": tool.parameters}
        if tool.description:
            definition["description"] = tool.description
        lines.append(json.dumps(definition, ensure_ascii=False))
    if tools.parser is not None:
        forced = {"named": f"Call the function {tools.named}. ", "required": "Call a function. "}
        lines.append(forced.get(tools.mode, "") + tools.parser.instructions())
    elif tools.mode == "named":
        lines.append(f"Call the function {tools.named}: answer with only its arguments as a JSON object.")
    elif tools.mode == "required" and tools.parallel:
        lines.append(f"Answer with only a JSON list of one or more function calls: [{_CALL}].")
    elif tools.mode == "required":
        lines.append(f"Answer with only one function call as JSON: {_CALL}.")
    else:
        lines.append(f"To call a function, answer with only a JSON object: {_CALL}. "
                     "To answer without calling a function, answer in plain text.")
    return "\n".join(lines)


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + text) if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _calls_as_text(messages: list[dict], parser: ToolParser | None = None) -> list[dict]:
    names: dict[str, str] = {}  # tool call id -> function name
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            for call in calls:
                names[call.get("id") or ""] = call["function"]["name"]
            if parser is not None:
                text = parser.render([ToolCall(c["function"]["name"], json.dumps(c["function"]["arguments"],
                                                                                 ensure_ascii=False)) for c in calls])
            else:
                text = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                            ensure_ascii=False) for c in calls)
            message["content"] = (message["content"] + "\n" + text) if message.get("content") else text
        if message["role"] == "tool":
            name = names.get(message.get("tool_call_id") or "") or message.get("name")
            if name:
                message["content"] = f"Result of {name}: {message['content']}"
        out.append(message)
    return out
