"""Formats that write their calls in one section of marker tokens (DeepSeek's, Kimi K2's):

    text <SECTION_BEGIN><CALL_BEGIN>call<CALL_END><CALL_BEGIN>call<CALL_END><SECTION_END> text

The text before the section is content, the text after it too; whitespace between calls is
allowed. A subclass names the markers and reads one call's text (`read_call`)."""
from __future__ import annotations

from typing import ClassVar

from .base import PartialCall, Scan, ToolParser, split_at_marker
from .json_scan import NotJSON, skip_space, value_end


class SectionCalls(ToolParser):
    section_begin: ClassVar[str]
    section_end: ClassVar[str]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]

    def scan(self, text: str, final: bool) -> Scan:
        content, index = split_at_marker(text, self.section_begin, final)
        scan = Scan(content=content)
        if index is None:
            return scan
        i = index + len(self.section_begin)
        while True:
            i = skip_space(text, i)
            if text.startswith(self.call_begin, i):
                body, end = split_at_marker(text, self.call_end, final, i + len(self.call_begin))
                call = self.read_call(body, final or end is not None)
                if call is None:
                    scan.malformed = True
                    return scan
                scan.calls.append(call)
                if end is None:
                    scan.malformed = final
                    return scan
                call.complete = True
                i = end + len(self.call_end)
            elif text.startswith(self.section_end, i):
                scan.trailing = text[i + len(self.section_end):].lstrip()
                scan.malformed = not scan.calls
                return scan
            elif i == len(text) or not final and any(marker.startswith(text[i:])
                                                      for marker in (self.call_begin, self.section_end)):
                scan.malformed = final and not scan.calls  # a section left open after its calls: they count
                return scan
            else:
                scan.malformed = True  # text in the section that is no call
                return scan

    def read_call(self, body: str, whole: bool) -> PartialCall | None:
        """One call from the text between CALL_BEGIN and CALL_END (`whole`: its end has been
        read); None if it is none."""
        raise NotImplementedError


def json_arguments(text: str, i: int, whole: bool, call: PartialCall, closing: str = "") -> PartialCall | None:
    """`call` with its arguments, the JSON object at `text[i]` (spaces before it skipped) as far
    as it is written; only `closing` (and spaces) may follow it, or while the call is not
    `whole`, `closing`'s first characters. None if the text is no such call."""
    i = skip_space(text, i)
    if i >= len(text):
        return None if whole else call
    if text[i] != "{":
        return None
    try:
        end = value_end(text, i, whole)
    except NotJSON:
        return None
    call.arguments = text[i:end if end is not None else len(text)]
    if end is None:
        return None if whole else call
    tail = text[end:].strip()
    return call if tail == closing or not whole and closing.startswith(tail) else None
