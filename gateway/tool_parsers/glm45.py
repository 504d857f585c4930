"""GLM-4.5 / 4.6 (and 4.7, which drops the newlines): each call in `<tool_call>` tags, its name
then one key and value pair of tags per argument, values as plain text:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>2</arg_value>
    </tool_call>

A value is read by its property's schema (values.py): a string stays as written, anything
else is JSON (or a Python literal). The arguments stream one finished pair at a time, as
JSON. A grammar requires the pairs as xgrammar's `glm_xml` style (xgrammar only)."""
from __future__ import annotations

import json
from collections.abc import Sequence

from .base import PartialCall, ToolCall, ToolSpec, split_at_marker
from .grammar import const, json_value, one_of, repeated, sequence
from .hermes import END, START, TaggedCalls
from .registry import register
from .values import typed_value

KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


@register
class Glm45ToolParser(TaggedCalls):
    name = "glm45"
    special_markers = (START, END, KEY, KEY_END, VALUE, VALUE_END)

    @classmethod
    def detects(cls, template: str) -> bool:
        return KEY in template

    @property
    def compact(self) -> bool:
        """Whether this model writes no newlines between the tags (GLM-4.7's template)."""
        return f"{KEY_END}{VALUE}" in self.context.template

    def read_body(self, body: str, whole: bool) -> PartialCall | None:
        ends = [i for i in (body.find("\n"), body.find(KEY)) if i != -1]
        if not ends:  # the name may go on, or is all there is (a call without arguments)
            if not whole:
                return PartialCall()
            return PartialCall(body.strip(), "{}") if body.strip() else None
        name = body[:min(ends)].strip()
        if not name:
            return None
        call = PartialCall(name, "{")
        i, first = min(ends), True
        while True:
            gap, at = split_at_marker(body, KEY, whole, i)
            if gap.strip():
                return None
            if at is None:
                if whole:
                    call.arguments += "}"
                return call
            key, key_end = split_at_marker(body, KEY_END, whole, at + len(KEY))
            if key_end is None:
                return None if whole else call
            j = key_end + len(KEY_END)
            value_at = body.find(VALUE, j)
            if value_at == -1 or body[j:value_at].strip():
                rest = body[j:].lstrip()
                return None if whole or value_at != -1 or not VALUE.startswith(rest) else call
            value, value_end = split_at_marker(body, VALUE_END, whole, value_at + len(VALUE))
            if value_end is None:
                return None if whole else call
            tool = self.tool(name)
            key = key.strip()
            parsed = typed_value(tool.parameters if tool is not None else None, key, value)
            call.arguments += ("" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": " + json.dumps(
                parsed, ensure_ascii=False)
            first = False
            i = value_end + len(VALUE_END)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        newline = "" if self.compact else "\n"
        calls = [sequence(self.literal(START), const(tool.name + newline), json_value(tool.parameters, "glm_xml"),
                          self.literal(END)) for tool in tools]
        return repeated(one_of(calls), "\n", parallel)

    def render(self, calls: Sequence[ToolCall]) -> str:
        newline = "" if self.compact else "\n"
        blocks = []
        for call in calls:
            pairs = "".join(f"{KEY}{key}{KEY_END}{newline}{VALUE}{_text(value)}{VALUE_END}{newline}"
                            for key, value in json.loads(call.arguments).items())
            blocks.append(f"{START}{call.name}{newline}{pairs}{END}")
        return "\n".join(blocks)

    def instructions(self) -> str:
        return (f"To call a function, answer with {START}<function name>\n{KEY}<argument name>{KEY_END}\n{VALUE}"
                f"<value>{VALUE_END}\n{END}, one key and value per argument and one such block per call. To answer "
                "without calling a function, answer in plain text.")


def _text(value) -> str:
    """A value as GLM's template writes it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
