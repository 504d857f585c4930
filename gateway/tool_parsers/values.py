"""A parameter written as plain text (Qwen3-Coder's and GLM-4.5's XML parameters) read as its
value, by the type its property's schema gives it, as vLLM's parsers read them: a string
stays as written, anything else is JSON (or a Python literal); a value that does not parse
stays a string."""
from __future__ import annotations

import json

from .pythonic import literal


def typed_value(parameters: dict | None, key: str, text: str):
    """`text`, the value of property `key` of a tool with `parameters` (None: an unknown tool)."""
    schema = ((parameters or {}).get("properties", {}).get(key) if isinstance(parameters, dict) else None) or {}
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "string" in kinds or kinds == {None} and not (isinstance(schema, dict) and "enum" in schema):
        return text
    for parse in (json.loads, literal):
        try:
            return parse(text.strip())
        except (ValueError, SyntaxError, RecursionError):
            continue
    return text
