"""Tool calls read as they are generated, for `tool_choice: required`: the grammar
makes the output `{"name": ..., "arguments": {...}}` (name first: the schema's
property order is the generation order) or a list of them, so a call's name is
known as soon as its string closes and its arguments can be sent in pieces.

Only the JSON structure is tracked (depth, strings, escapes); the grammar
guarantees the rest."""
from __future__ import annotations

import json


class CallScanner:
    def __init__(self):
        self._depth = 0  # open containers
        self._in_string = False
        self._escaped = False
        self._call_depth: int | None = None  # depth inside a call object: 1 (one call) or 2 (a list)
        self._expect_key = False
        self._key: str | None = None
        self._token: list[str] | None = None  # a string at call depth, being read
        self._in_arguments = False
        self.num_calls = 0

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Events of `text`: ("call", name) when a call starts, ("arguments", piece)."""
        events: list[tuple[str, str]] = []
        piece: list[str] = []
        for ch in text:
            was_in_string = self._in_string
            self._step(ch)
            if self._in_arguments:
                piece.append(ch)
                if self._depth == self._call_depth and not self._in_string:
                    self._in_arguments = False
                continue
            if piece:
                events.append(("arguments", "".join(piece)))
                piece = []
            event = self._structure(ch, was_in_string)
            if self._in_arguments:  # the brace that opens them
                piece.append(ch)
            elif event is not None:
                events.append(event)
        if piece:
            events.append(("arguments", "".join(piece)))
        return events

    def _step(self, ch: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1

    def _structure(self, ch: str, was_in_string: bool) -> tuple[str, str] | None:
        if self._call_depth is None and ch in "{[":
            self._call_depth = 2 if ch == "[" else 1
        if self._token is not None:  # a key or a value at call depth
            self._token.append(ch)
            if not self._in_string:
                return self._end_token()
            return None
        if was_in_string or self._in_string:
            if ch == '"' and self._depth == self._call_depth:
                self._token = [ch]
            return None
        if ch == "{" and self._depth == self._call_depth:
            self._expect_key, self._key = True, None
        elif ch == "," and self._depth == self._call_depth:
            self._expect_key = True
        elif ch == ":" and self._depth == self._call_depth:
            self._expect_key = False
        elif ch == "{" and self._depth == (self._call_depth or 0) + 1 and self._key == "arguments" \
                and not self._expect_key:
            self._in_arguments = True
        return None

    def _end_token(self) -> tuple[str, str] | None:
        text = json.loads("".join(self._token))
        self._token = None
        if self._expect_key:
            self._key = text
            return None
        if self._key == "name":
            self.num_calls += 1
            return ("call", text)
        return None


def scanned_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments text) of each call in a whole output."""
    calls: list[list[str]] = []
    for kind, value in CallScanner().feed(text):
        if kind == "call":
            calls.append([value, ""])
        elif calls:
            calls[-1][1] += value
    return [(name, arguments) for name, arguments in calls]
