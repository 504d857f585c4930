"""A parser's reading of one output, whole (`parse_output`) or as it is generated
(`CallStream`), in dialect-neutral events:

    ("content", text)            text of the answer
    ("call", index, name)        a call begins (its name is known)
    ("arguments", index, piece)  the next piece of that call's arguments (JSON text)

Which calls count is decided here once (`validated`): every call finished, its name one of
the tools, its arguments a JSON object; otherwise the whole output is content, as vLLM's
parsers leave a malformed call. A stream holds back what may still become a call (a
marker's first characters, a call whose name is unfinished) and sends a call's name as soon
as it is known and its arguments as they grow; if the output turns out malformed before
any call was sent, what was held is sent as content at the end (a call already sent stays,
as does one the length limit cut off)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .base import PartialCall, Scan, ToolCall, ToolParser, held_back

Event = tuple


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when there is no text besides the calls
    calls: tuple[ToolCall, ...]


class TextFilter:
    """Removes `texts` (the special tokens a format kept in the output for its markers, but
    the client asked to skip) from a growing text; a piece that may begin one is held back."""

    def __init__(self, texts: frozenset[str]):
        self._texts = tuple(sorted(texts, key=len, reverse=True))

    def text(self, raw: str, final: bool) -> str:
        for text in self._texts:
            raw = raw.replace(text, "")
        if final or not self._texts:
            return raw
        return raw[:len(raw) - max(held_back(raw, text) for text in self._texts)]


def validated(scan: Scan, names: set[str], parallel: bool) -> tuple[ToolCall, ...] | None:
    """The calls of a whole output's scan, or None when it holds a malformed one."""
    if scan.malformed:
        return None
    calls = []
    for call in scan.calls:
        arguments = _object(call.arguments)
        if not call.complete or call.name not in names or arguments is None:
            return None
        calls.append(ToolCall(call.name, json.dumps(arguments, ensure_ascii=False), call.call_id))
    return tuple(calls if parallel else calls[:1])


def _object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def cut_calls(scan: Scan, names: set[str], parallel: bool) -> tuple[ToolCall, ...]:
    """The calls of an output cut off by the length limit: each begun with a known name, its
    arguments as far as they were written."""
    calls = []
    for call in scan.calls if parallel else scan.calls[:1]:
        if call.name not in names:
            break
        calls.append(ToolCall(call.name, call.arguments, call.call_id))
    return tuple(calls)


def parse_output(parser: ToolParser, text: str, parallel: bool = True, hidden: frozenset[str] = frozenset(),
                 cut_off: bool = False) -> ParsedOutput:
    """A whole output read by `parser`: its calls and the text beside them, or all of it as
    content when a call is malformed; an output `cut_off` by the length limit keeps the calls
    it began (`hidden`: special-token texts to drop first)."""
    text = TextFilter(hidden).text(text, final=True)
    scan = parser.scan(text, final=True)
    names = {tool.name for tool in parser.tools}
    calls = validated(scan, names, parallel)
    if calls is None and cut_off:  # read as unfinished: it was
        scan = parser.scan(text, final=False)
        calls, scan.trailing = cut_calls(scan, names, parallel), ""
    if not calls:
        return ParsedOutput(text, ())
    content = scan.content + scan.trailing
    return ParsedOutput(content if content.strip() else None, calls)


class CallStream:
    """One output read as it grows: `feed` each text delta, then `finish`; both return events."""

    def __init__(self, parser: ToolParser, parallel: bool = True, hidden: frozenset[str] = frozenset()):
        self._parser = parser
        self._names = {tool.name for tool in parser.tools}
        self._parallel = parallel
        self._filter = TextFilter(hidden)
        self._raw = ""
        self._content = 0  # characters of content sent
        self._trailing = 0  # characters of text after the calls sent
        self._arguments: list[int] = []  # per call sent: characters of its arguments sent
        self._ids: list[str | None] = []  # per call sent: the id the model wrote for it, if any

    @property
    def num_calls(self) -> int:
        return len(self._arguments)

    def call_id(self, index: int) -> str | None:
        """The id the model wrote for call `index` (sent), in formats that write one (Kimi K2's)."""
        return self._ids[index] if index < len(self._ids) else None

    def feed(self, delta: str) -> list[Event]:
        self._raw += delta
        return self._events(self._parser.scan(self._filter.text(self._raw, final=False), final=False))

    def finish(self, cut_off: bool = False) -> list[Event]:
        """The last events; `cut_off`: the output ended at the length limit (calls begun stay)."""
        text = self._filter.text(self._raw, final=True)
        scan = self._parser.scan(text, final=True)
        if validated(scan, self._names, self._parallel) is None:
            if cut_off:  # read as unfinished: it was
                scan = self._parser.scan(text, final=False)
            if not self._arguments and not (cut_off and cut_calls(scan, self._names, self._parallel)):
                return self._content_events(text, final=True)  # no call: the whole output is text
            scan.trailing = ""  # the calls sent stay; what cannot be a call is dropped
        return self._events(scan, final=True)

    def _events(self, scan: Scan, final: bool = False) -> list[Event]:
        events = [] if self._arguments else self._content_events(scan.content, final, bool(scan.calls))
        for index, call in enumerate(scan.calls if self._parallel else scan.calls[:1]):
            if not self._call_events(index, call, events):
                return events
        if self._arguments and scan.trailing[self._trailing:].strip():
            events.append(("content", scan.trailing[self._trailing:]))
            self._trailing = len(scan.trailing)
        return events

    def _content_events(self, content: str, final: bool, calls_follow: bool = False) -> list[Event]:
        """Content is sent once it holds more than whitespace (a blank line before a call is
        no answer); at the end, whitespace alone is sent only if no call follows."""
        piece = content[self._content:]
        if not piece or not content.strip() and (calls_follow or not final):
            return []
        self._content = len(content)
        return [("content", piece)]

    def _call_events(self, index: int, call: PartialCall, events: list[Event]) -> bool:
        """Events of call `index`; False while it cannot be sent yet (the later ones wait too)."""
        if call.name is None or call.name not in self._names:
            return False
        if index == len(self._arguments):
            events.append(("call", index, call.name))
            self._arguments.append(0)
            self._ids.append(call.call_id)
        sent = self._arguments[index]
        piece = call.arguments[sent:]
        if piece:
            events.append(("arguments", index, piece))
            self._arguments[index] = len(call.arguments)
        return call.complete
