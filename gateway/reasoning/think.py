"""The thinking block of DeepSeek-R1, Qwen3 and Mistral's Magistral: `<think>...</think>`
(`[THINK]...[/THINK]`) before the answer, split out of the output text incrementally.

Where the output starts (formats.py decides it from the prompt):
- `thinking`: the template opened the block (DeepSeek-R1's, Qwen3-Thinking's), or the model
  opens it unprompted (DeepSeek-R1); everything up to the end marker is reasoning (a start
  marker the model writes all the same is dropped), and an output without one is all reasoning;
- `maybe`: the model may open it: an output that begins (past whitespace) with the start
  marker thinks, any other is all answer;
- `answer`: the template closed it (Qwen3 with enable_thinking false): all answer.

The reasoning loses the whitespace around it, the answer the whitespace after the end marker
(the "\\n\\n" templates put there). `drops` (the end-of-sequence tokens' text, when special
tokens are kept for the markers' sake) are removed wherever they appear."""
from __future__ import annotations

from .pieces import Piece, Splitter, held_suffix, without


class ThinkSplitter(Splitter):
    def __init__(self, start: str, end: str, state: str, drops: tuple[str, ...] = ()):
        self._start = start
        self._end = end
        self._state = state  # "maybe" | "thinking" | "answer"
        self._drops = tuple(d for d in drops if d)
        self._buffer = ""  # text not handed out yet
        self._reasoning_begun = False  # the reasoning's leading whitespace is dropped
        self._trailing = ""  # whitespace at the reasoning's end so far: dropped if the block ends there
        self._trim_answer = False  # an answer after a thinking block: its leading whitespace is dropped
        self._may_open = True  # the thinking may still begin with the start marker (dropped)

    def _run(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        self._buffer = without(self._buffer, self._drops)
        while True:
            if self._state == "maybe":
                head = self._buffer.lstrip()
                if head.startswith(self._start):
                    self._buffer, self._state, self._may_open = head[len(self._start):], "thinking", False
                elif not final and (self._start.startswith(head) or self._held(head) == len(head)):
                    return pieces  # not known yet
                else:
                    self._state = "answer"
            elif self._state == "thinking":
                if self._may_open:  # a model that writes the start marker the template wrote already
                    head = self._buffer.lstrip()
                    if not final and head != self._start and self._start.startswith(head):
                        return pieces  # not known yet
                    self._may_open = False
                    if head.startswith(self._start):
                        self._buffer = head[len(self._start):]
                index = self._buffer.find(self._end)
                if index >= 0:
                    self._reason(pieces, self._buffer[:index], closing=True)
                    self._buffer, self._state, self._trim_answer = self._buffer[index + len(self._end):], "answer", True
                    continue
                keep = 0 if final else self._held(self._buffer, self._end)
                self._reason(pieces, self._buffer[:len(self._buffer) - keep], closing=final)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return pieces
            else:
                keep = 0 if final else self._held(self._buffer)
                text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                if self._trim_answer:
                    text = text.lstrip()
                    self._trim_answer = not text
                if text:
                    pieces.append(("content", text))
                return pieces

    def _held(self, text: str, *markers: str) -> int:
        return held_suffix(text, (*markers, *self._drops))

    def _reason(self, pieces: list[Piece], text: str, closing: bool) -> None:
        text = self._trailing + text
        if not self._reasoning_begun:
            text = text.lstrip()
        body = text.rstrip()
        self._trailing = "" if closing else text[len(body):]
        if body:
            self._reasoning_begun = True
            pieces.append(("reasoning", body))
