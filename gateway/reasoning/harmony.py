"""gpt-oss's harmony format, split out of the output text incrementally: messages
`<|start|>assistant<|channel|>NAME[ to=RECIPIENT][ <|constrain|>FORMAT]<|message|>BODY`
ended by `<|end|>`, `<|return|>` or `<|call|>` (the prompt ends in `<|start|>assistant`, so the
output opens with `<|channel|>`).

- channel `analysis`: reasoning;
- channel `final`, and `commentary` without a recipient (a preamble the user may see): answer;
- a message with a recipient (`to=functions.NAME`: a tool call) is answer text as it was
  written, header and `<|call|>` included, for a tool-call parser to read;
- text outside any message (a model that ignores the format): answer.

Where the output starts (formats.py): `maybe` reads headers from the start, `thinking` is
inside an analysis message, `answer` inside the final one."""
from __future__ import annotations

import re

from .pieces import Kind, Piece, Splitter, held_suffix, without

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
_MESSAGE_ENDS = (END, RETURN, CALL)
_HEADER_STARTS = (START, CHANNEL)  # a header met in a body ends it (a model that skipped <|end|>)
_MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
ANALYSIS_HEADER = CHANNEL + "analysis" + MESSAGE
FINAL_HEADER = CHANNEL + "final" + MESSAGE

_TOOL_CALL = "call"  # a body passed through as it was written


class HarmonySplitter(Splitter):
    def __init__(self, state: str, drops: tuple[str, ...] = ()):
        self._drops = tuple(d for d in drops if d and d not in _MARKERS)
        self._buffer = ""
        # "header" (reading one), or the body's destination: "reasoning", "content" or _TOOL_CALL
        self._state = {"thinking": "reasoning", "answer": "content"}.get(state, "header")

    def _run(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        self._buffer = without(self._buffer, self._drops)
        while True:
            if self._state == "header":
                index = self._buffer.find(MESSAGE)
                if index < 0:
                    if not self._looks_like_header(self._buffer):
                        self._state = "content"  # plain text, not a harmony message
                        continue
                    if final:
                        self._buffer = ""  # a header cut short: nothing to show
                    return pieces
                header, self._buffer = self._buffer[:index], self._buffer[index + len(MESSAGE):]
                self._state = _destination(header)
                if self._state == _TOOL_CALL:
                    pieces.append(("content", header + MESSAGE))
                continue
            found = [(i, marker) for marker in (*_MESSAGE_ENDS, *_HEADER_STARTS)
                     if (i := self._buffer.find(marker)) >= 0]
            if not found:
                keep = 0 if final else held_suffix(self._buffer, (*_MARKERS, *self._drops))
                self._emit(pieces, self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return pieces
            index, marker = min(found)
            self._emit(pieces, self._buffer[:index] + (marker if self._state == _TOOL_CALL and marker == CALL else ""))
            self._buffer = self._buffer[index + (len(marker) if marker in _MESSAGE_ENDS else 0):]
            self._state = "header"

    def _emit(self, pieces: list[Piece], text: str) -> None:
        if text:
            kind: Kind = "reasoning" if self._state == "reasoning" else "content"
            pieces.append((kind, text))

    @staticmethod
    def _looks_like_header(text: str) -> bool:
        head = text.lstrip()
        return any(head.startswith(marker) or marker.startswith(head) for marker in _HEADER_STARTS)


def _destination(header: str) -> str:
    """Where a message's body goes, from its header."""
    if "to=" in header:
        return _TOOL_CALL
    name = _CHANNEL_NAME.search(header)
    return "reasoning" if name is not None and name.group(1) == "analysis" else "content"
