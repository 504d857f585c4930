"""JSON read as it is generated: where a value ends, and the members of an object that may
still be growing. Only the structure is followed (strings, escapes, nesting); whether a
finished value is valid JSON is json.loads' to say, once it is whole."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_WHITESPACE = " \t\r\n"
_SCALAR_END = ",}] \t\r\n;"


class NotJSON(ValueError):
    """The text cannot be the JSON it should be."""


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int, final: bool = False) -> int | None:
    """The index after the JSON value that starts at `text[i]`, or None while it is unfinished.
    A scalar at the end of the text is unfinished unless `final` (a number may go on)."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        return _string_end(text, i)
    if first in "{[":
        depth, j, in_string, escaped = 0, i, False, False
        while j < len(text):
            ch = text[j]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if first in "}],:":
        raise NotJSON(f"no JSON value at {first!r}")
    j = i
    while j < len(text) and text[j] not in _SCALAR_END:
        j += 1
    return j if j < len(text) or final else None


def _string_end(text: str, i: int) -> int | None:
    escaped = False
    for j in range(i + 1, len(text)):
        ch = text[j]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return j + 1
    return None


@dataclass
class Member:
    key: str
    start: int  # where its value starts
    end: int | None  # after its value; None while unfinished


@dataclass
class ObjectScan:
    members: list[Member] = field(default_factory=list)
    end: int | None = None  # after the closing brace; None while open

    def member(self, *keys: str) -> Member | None:
        return next((m for m in self.members if m.key in keys), None)


def scan_object(text: str, i: int, final: bool = False) -> ObjectScan:
    """The members of the object whose `{` is `text[i]`, as far as they are written.
    Raises NotJSON where the text cannot continue an object."""
    if text[i] != "{":
        raise NotJSON("an object starts with {")
    scan = ObjectScan()
    j = skip_space(text, i + 1)
    if j < len(text) and text[j] == "}":
        scan.end = j + 1
        return scan
    while j < len(text):
        if text[j] != '"':
            raise NotJSON("an object's key is a string")
        key_end = _string_end(text, j)
        if key_end is None:
            return scan
        key = json.loads(text[j:key_end])
        j = skip_space(text, key_end)
        if j >= len(text):
            return scan
        if text[j] != ":":
            raise NotJSON("a key is followed by :")
        j = skip_space(text, j + 1)
        if j >= len(text):
            return scan
        member = Member(key, j, value_end(text, j, final))
        scan.members.append(member)
        if member.end is None:
            return scan
        j = skip_space(text, member.end)
        if j >= len(text):
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] != ",":
            raise NotJSON("members are separated by ,")
        j = skip_space(text, j + 1)
    return scan


def name_of(text: str, member: Member | None) -> str | None:
    """A finished member's value as a string (a call's name), else None."""
    if member is None or member.end is None:
        return None
    try:
        value = json.loads(text[member.start:member.end])
    except json.JSONDecodeError as exc:
        raise NotJSON(str(exc)) from None
    if not isinstance(value, str):
        raise NotJSON("a call's name is a string")
    return value


def arguments_of(text: str, member: Member | None, closed: bool) -> str:
    """A call's arguments as JSON text so far: an object streams as it is written; arguments
    written as a JSON string (some models do) are decoded once whole. Missing: `{}` once the
    call is `closed`."""
    if member is None:
        return "{}" if closed else ""
    if text[member.start] == "{":
        return text[member.start:member.end if member.end is not None else len(text)]
    if member.end is None:
        return ""
    value = json.loads(text[member.start:member.end])
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
