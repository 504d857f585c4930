"""Qwen3-Coder (and Qwen3.5 / Qwen3-Next templates that write XML calls): each call in
`<tool_call>` tags as XML, one parameter per tag, values as plain text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is read by its property's schema, as vLLM's qwen3_coder parser does: a string stays
as written (one newline on each side trimmed), anything else is JSON (or a Python literal);
a value that does not parse stays a string. The arguments stream one finished parameter at a
time, as JSON. A grammar requires the parameters as xgrammar's `qwen_xml` style (xgrammar only)."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence

from .base import PartialCall, ToolCall, ToolSpec, split_at_marker
from .grammar import const, json_value, one_of, repeated, sequence
from .hermes import END, START, TaggedCalls
from .registry import register
from .values import typed_value

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_TAG_NAME = re.compile(r"([^>\n]*)>")


@register
class Qwen3CoderToolParser(TaggedCalls):
    name = "qwen3_coder"

    @classmethod
    def detects(cls, template: str) -> bool:
        return FUNCTION in template and PARAMETER in template

    def read_body(self, body: str, whole: bool) -> PartialCall | None:
        head, index = split_at_marker(body, FUNCTION, whole)
        if head.strip():
            return None
        if index is None:
            return None if whole else PartialCall()
        name = _TAG_NAME.match(body, index + len(FUNCTION))
        if name is None:
            return None if whole or "\n" in body[index:] or ">" in body[index:] else PartialCall()
        call = PartialCall(name.group(1).strip(), "{")
        i = name.end()
        first = True
        while True:
            gap, at = split_at_marker(body, PARAMETER, whole, i)
            closing = body.find(FUNCTION_END, i)
            if closing != -1 and (at is None or closing < at):
                if body[i:closing].strip() or body[closing + len(FUNCTION_END):].strip():
                    return None
                call.arguments += "}"
                return call
            if gap.strip():
                return None
            if at is None:
                return None if whole else call
            key = _TAG_NAME.match(body, at + len(PARAMETER))
            if key is None:
                return None if whole else call
            value, end = split_at_marker(body, PARAMETER_END, whole, key.end())
            if end is None:
                return None if whole else call
            pair = json.dumps(key.group(1).strip()) + ": " + json.dumps(self._value(call.name, key.group(1).strip(),
                                                                                      value), ensure_ascii=False)
            call.arguments += ("" if first else ", ") + pair
            first = False
            i = end + len(PARAMETER_END)

    def _value(self, function: str, key: str, text: str):
        """A parameter's text (one newline on each side trimmed) as its value, by its schema's type."""
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        tool = self.tool(function)
        return typed_value(tool.parameters if tool is not None else None, key, text)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        calls = [sequence(const(f"{START}\n{FUNCTION}{tool.name}>\n"), json_value(tool.parameters, "qwen_xml"),
                          const(f"{FUNCTION_END}\n{END}")) for tool in tools]
        return repeated(one_of(calls), "\n", parallel)

    def render(self, calls: Sequence[ToolCall]) -> str:
        blocks = []
        for call in calls:
            parameters = "".join(f"{PARAMETER}{key}>\n{value if isinstance(value, str) else json.dumps(value)}\n"
                                 f"{PARAMETER_END}\n" for key, value in json.loads(call.arguments).items())
            blocks.append(f"{START}\n{FUNCTION}{call.name}>\n{parameters}{FUNCTION_END}\n{END}")
        return "\n".join(blocks)

    def instructions(self) -> str:
        return (f"To call a function, answer with {START}\n{FUNCTION}<function name>>\n{PARAMETER}<parameter name>>\n"
                f"<value>\n{PARAMETER_END}\n{FUNCTION_END}\n{END}, one such block per call. To answer without "
                "calling a function, answer in plain text.")
