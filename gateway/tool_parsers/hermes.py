"""Hermes / Qwen2.5 / Qwen3: each call a JSON object in tags, text before them is content.

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from __future__ import annotations

import json
from collections.abc import Sequence

from .base import PartialCall, Scan, ToolCall, ToolParser, ToolSpec, split_at_marker
from .grammar import call_object, const, json_value, one_of, repeated, sequence
from .json_scan import NotJSON, arguments_of, name_of, scan_object, skip_space
from .registry import register

START, END = "<tool_call>", "</tool_call>"


class TaggedCalls(ToolParser):
    """Calls between START and END tags; the text before the first is content, the text after
    each (leading whitespace dropped) is content too. Subclasses read one call's body."""

    def scan(self, text: str, final: bool) -> Scan:
        content, index = split_at_marker(text, START, final)
        scan = Scan(content=content)
        pieces = []
        while index is not None:
            body_start = index + len(START)
            body, end = split_at_marker(text, END, final, body_start)
            call = self.read_body(body, final or end is not None)
            if call is None:
                scan.malformed = True
                return scan
            scan.calls.append(call)
            if end is None:
                if final:
                    scan.malformed = True
                return scan
            call.complete = True
            after = end + len(END)
            gap, index = split_at_marker(text, START, final, after)
            pieces.append(gap.lstrip())
        scan.trailing = "".join(pieces)
        return scan

    def read_body(self, body: str, whole: bool) -> PartialCall | None:
        """One call from the text after START (`whole`: its END has been read); None if it is none."""
        raise NotImplementedError


@register
class HermesToolParser(TaggedCalls):
    name = "hermes"

    @classmethod
    def detects(cls, template: str) -> bool:
        return START in template and "<function=" not in template and "<arg_key>" not in template

    def read_body(self, body: str, whole: bool) -> PartialCall | None:
        i = skip_space(body, 0)
        if i >= len(body):
            return None if whole else PartialCall()
        try:
            obj = scan_object(body, i, whole)
            name = name_of(body, obj.member("name"))
            arguments = arguments_of(body, obj.member("arguments", "parameters"), obj.end is not None)
        except (NotJSON, json.JSONDecodeError):
            return None
        if whole and (obj.end is None or body[obj.end:].strip()):
            return None
        return PartialCall(name, arguments)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        calls = [json_value(call_object(tool.name, "arguments", tool.parameters)) for tool in tools]
        one = sequence(const(START + "\n"), one_of(calls), const("\n" + END))
        return repeated(one, "\n", parallel)

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(f"{START}\n" + json.dumps({"name": call.name, "arguments": json.loads(call.arguments)},
                                                   ensure_ascii=False) + f"\n{END}" for call in calls)

    def instructions(self) -> str:
        return (f'To call a function, answer with {START}{{"name": <function name>, "arguments": <arguments '
                f'object>}}{END}, one such block per call. To answer without calling a function, answer in '
                "plain text.")
