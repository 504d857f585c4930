"""What a splitter hands out, and the text helpers both splitters share.

A splitter (think.py, harmony.py) is fed an output's text deltas, in order, and returns
`Piece`s: ("reasoning", text) or ("content", text), in output order. It holds back only the
end of a delta that may be the start of a marker (a marker split over deltas), and gives
it out once the next delta, or `finish()`, tells."""
from __future__ import annotations

from typing import Literal

Kind = Literal["reasoning", "content"]
Piece = tuple[Kind, str]


class Splitter:
    """Buffers the deltas; a splitter's `_run` hands out what its buffer now tells (all of it
    when `final`)."""
    _buffer: str

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Piece]:
        raise NotImplementedError


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the beginning (not the whole) of a marker."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


def without(text: str, drops: tuple[str, ...]) -> str:
    """`text` with every whole occurrence of the `drops` removed."""
    for drop in drops:
        if drop:
            text = text.replace(drop, "")
    return text


def joined(pieces: list[Piece]) -> tuple[str | None, str]:
    """(the reasoning, or None when there is none; the content) of a whole output's pieces."""
    reasoning = "".join(text for kind, text in pieces if kind == "reasoning")
    content = "".join(text for kind, text in pieces if kind == "content")
    return reasoning or None, content
