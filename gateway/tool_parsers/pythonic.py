"""Pythonic calls (Llama 3.2 / 4 with a pythonic template, ToolACE): an answer that is calls
is a Python list of them, keyword arguments only, Python or JSON literals as values.

    [get_weather(city="Paris"), get_time(tz="UTC", precise=True)]

Read without eval: each argument's value is parsed with `ast` as a literal (True/False/None
and true/false/null alike). The arguments stream one finished argument at a time, as JSON.
A grammar writes each value as compact JSON of its property's schema (valid Python too, but
for true/false/null, which this parser reads)."""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence

from .base import PartialCall, Scan, ToolCall, ToolParser, ToolSpec
from .grammar import const, json_value, one_of, optional, property_schema, sequence
from .json_scan import NotJSON, skip_space
from .registry import register

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_KEYWORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_JSON_NAMES = {"true": True, "false": False, "null": None}


@register
class PythonicToolParser(ToolParser):
    name = "pythonic"

    @classmethod
    def detects(cls, template: str) -> bool:
        return "[func_name1(" in template or "func_name1(params_name1=" in template

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_space(text, 0)
        if i >= len(text):
            return Scan(content=text if final else "")
        if text[i] != "[":
            return Scan(content=text)
        scan = Scan()
        try:
            end = self._calls(text, skip_space(text, i + 1), final, scan)
        except (NotJSON, ValueError, SyntaxError):
            return Scan(content=text, malformed=True)
        if end is None:
            scan.malformed = final
        elif text[end:].strip():
            return Scan(content=text, malformed=True)
        return scan

    def _calls(self, text: str, i: int, final: bool, scan: Scan) -> int | None:
        """Reads calls from `i`; the index after the closing `]`, or None while unfinished."""
        while i < len(text):
            if text[i] == "]" and scan.calls:
                return i + 1
            name = _NAME.match(text, i)
            if name is None or name.end() == len(text):
                if name is None:
                    raise NotJSON("a call starts with its name")
                return None
            j = skip_space(text, name.end())
            if j >= len(text):
                return None
            if text[j] != "(":
                raise NotJSON("a call's name is followed by (")
            call = PartialCall(name.group(), "{")
            scan.calls.append(call)
            i = self._arguments(text, skip_space(text, j + 1), call)
            if i is None:
                return None
            i = skip_space(text, i)
            if i < len(text) and text[i] == ",":
                i = skip_space(text, i + 1)
            elif i < len(text) and text[i] != "]":
                raise NotJSON("calls are separated by ,")
        return None

    def _arguments(self, text: str, i: int, call: PartialCall) -> int | None:
        """Reads `key=value, ...)`; the index after `)`, or None while unfinished. Each finished
        argument joins `call.arguments`."""
        first = True
        while i < len(text):
            if text[i] == ")":
                call.arguments += "}"
                call.complete = True
                return i + 1
            keyword = _KEYWORD.match(text, i)
            if keyword is None:
                raise NotJSON("arguments are keyword arguments")
            j = skip_space(text, keyword.end())
            if j >= len(text):
                return None
            if text[j] != "=":
                raise NotJSON("a keyword is followed by =")
            start = skip_space(text, j + 1)
            end = _value_end(text, start)
            if end is None:
                return None
            value = literal(text[start:end])
            call.arguments += ("" if first else ", ") + json.dumps(keyword.group()) + ": " + \
                json.dumps(value, ensure_ascii=False)
            first = False
            i = skip_space(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_space(text, i + 1)
            elif i < len(text) and text[i] != ")":
                raise NotJSON("arguments are separated by ,")
        return None

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        calls = one_of([sequence(const(tool.name + "("), *_arguments_grammar(tool.parameters), const(")"))
                        for tool in tools])
        if not parallel:
            return sequence(const("["), calls, const("]"))
        return sequence(const("["), calls, {"type": "star", "content": sequence(const(", "), calls)}, const("]"))

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "[" + ", ".join(
            call.name + "(" + ", ".join(f"{key}={python_literal(value)}"
                                        for key, value in json.loads(call.arguments).items()) + ")"
            for call in calls) + "]"

    def instructions(self) -> str:
        return ("To call functions, answer with only a Python list of calls with keyword arguments: "
                "[func_name1(param1=value1, param2=value2), func_name2(...)]. To answer without calling a function, "
                "answer in plain text.")


def _value_end(text: str, i: int) -> int | None:
    """The index after the literal that starts at `i`: at the `,` or `)` that follows it outside
    strings and brackets; None while unfinished."""
    depth, quote, escaped = 0, None, False
    for j in range(i, len(text)):
        ch = text[j]
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return j if ch == ")" and j > i else _bad(ch)
            depth -= 1
        elif ch == "," and depth == 0:
            return j if j > i else _bad(ch)
    return None


def _bad(ch: str):
    raise NotJSON(f"no value before {ch!r}")


def literal(text: str):
    """A Python (or JSON) literal as a JSON value; ValueError if it is none."""
    return _value(ast.parse(text.strip(), mode="eval").body)


def _value(node):
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and isinstance(node.operand.value, (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_value(key) for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("object keys are strings")
        return {key: _value(value) for key, value in zip(keys, node.values)}
    raise ValueError(f"not a literal: {ast.dump(node)[:40]}")


def python_literal(value) -> str:
    """A JSON value written as a Python literal."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float, str)):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(item) for item in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {python_literal(v)}" for k, v in value.items()) + "}"


def _arguments_grammar(parameters: dict) -> list[dict]:
    """`key=value` for each property: the required ones first, always; then each optional one
    may follow. Without required ones, the first argument written may be any of them, so
    that no comma dangles (quadratic in the properties, which stay few)."""
    keys = list(parameters.get("properties", {}))
    required = [key for key in keys if key in parameters.get("required", ())]
    rest = [key for key in keys if key not in required]

    def argument(key: str) -> dict:
        return sequence(const(key + "="), json_value(property_schema(parameters, key)))

    def tail(keys_after: list[str]) -> list[dict]:
        return [optional(sequence(const(", "), argument(key))) for key in keys_after]

    if required:
        elements = [argument(required[0])]
        elements += [sequence(const(", "), argument(key)) for key in required[1:]]
        return elements + tail(rest)
    if not rest:
        return []
    return [optional(one_of([sequence(argument(key), *tail(rest[i + 1:])) for i, key in enumerate(rest)]))]
