"""Llama 3.1 / 3.2 / 3.3 with JSON tools: an answer that is a call is only the call, a JSON
object with `parameters` (or `arguments`), optionally after `<|python_tag|>`; several are
separated by `;` (or only by whitespace, as some write them).

    {"name": "get_weather", "parameters": {"city": "Paris"}}

`<|python_tag|>` is a special token: skipped from the text as usual, the bare JSON remains."""
from __future__ import annotations

import json
from collections.abc import Sequence

from .base import PartialCall, Scan, ToolCall, ToolParser, ToolSpec
from .grammar import call_object, json_value, one_of, repeated
from .json_scan import NotJSON, arguments_of, name_of, scan_object, skip_space
from .registry import register

PYTHON_TAG = "<|python_tag|>"


@register
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    @classmethod
    def detects(cls, template: str) -> bool:
        return "<|start_header_id|>" in template and (
            PYTHON_TAG in template or "JSON for a function call" in template) and "[func_name1(" not in template

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_space(text, i + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(text[i:]) and not final:
            return Scan()  # the tag's first characters: undecided
        if i >= len(text):
            return Scan(content=text if final else "")
        if text[i] != "{":
            return Scan(content=text)
        scan = Scan()
        try:
            while True:
                obj = scan_object(text, i, final)
                call = PartialCall(name_of(text, obj.member("name")),
                                   arguments_of(text, obj.member("parameters", "arguments"), obj.end is not None),
                                   obj.end is not None)
                scan.calls.append(call)
                if obj.end is None:
                    scan.malformed = final
                    return scan
                i = skip_space(text, obj.end)
                if i >= len(text):
                    return scan
                if text[i] == ";":
                    i = skip_space(text, i + 1)
                elif text[i] != "{":
                    raise NotJSON("calls are separated by ; or whitespace")
                if i >= len(text):
                    return scan
        except (NotJSON, json.JSONDecodeError):
            return Scan(content=text, malformed=True)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        calls = [json_value(call_object(tool.name, "parameters", tool.parameters)) for tool in tools]
        return repeated(one_of(calls), "; ", parallel)

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": call.name, "parameters": json.loads(call.arguments)},
                                    ensure_ascii=False) for call in calls)

    def instructions(self) -> str:
        return ('To call a function, answer with only a JSON object {"name": <function name>, "parameters": '
                "<arguments object>}. To answer without calling a function, answer in plain text.")
