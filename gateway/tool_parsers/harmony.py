"""gpt-oss (`openai`, vLLM's name): a call is a harmony message addressed to the function,
its arguments the message's body, ended by `<|call|>`:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(after an earlier message, `<|start|>assistant` opens it; the recipient may also stand before
the channel). With `--reasoning-parser gpt_oss` the reasoning side (gateway/reasoning/harmony.py)
has already taken the analysis out and passes such a message on as answer text, header and
`<|call|>` included; without it the raw output is read, and messages that are no call stay
text. `<|call|>` ends generation in gpt-oss (an end-of-sequence token): a call whose body is
whole at the end of the output counts without it."""
from __future__ import annotations

import re
from collections.abc import Sequence

from .base import PartialCall, Scan, ToolCall, ToolParser, ToolSpec, held_back
from .grammar import const, json_value, one_of, sequence
from .registry import register
from .sections import json_arguments

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
CALL, END = "<|call|>", "<|end|>"
_HEADER_STARTS = (START, CHANNEL)
_BODY_ENDS = (CALL, END, START, CHANNEL)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


@register
class OpenAIToolParser(ToolParser):
    name = "openai"
    special_markers = (START, CHANNEL, MESSAGE, CALL)

    @classmethod
    def detects(cls, template: str) -> bool:
        return CHANNEL in template and ("to=functions." in template or "namespace functions" in template)

    def scan(self, text: str, final: bool) -> Scan:
        scan, outside, i = Scan(), [], 0
        while True:
            header = _next_header(text, i)
            message = text.find(MESSAGE, header) if header is not None else -1
            if header is None or message == -1:
                end = len(text) if final else (header if header is not None else
                                               len(text) - max(held_back(text, m) for m in _HEADER_STARTS))
                outside.append(text[i:max(end, i)])
                break
            recipient = _RECIPIENT.search(text, header, message)
            if recipient is None:  # a message to no function: text, header and all
                outside.append(text[i:message + len(MESSAGE)])
                i = message + len(MESSAGE)
                continue
            outside.append(text[i:header])
            if not scan.calls:
                scan.content, outside = "".join(outside), []
            call, i = self._call(text, message + len(MESSAGE), final, recipient.group(1))
            if call is None:
                scan.malformed = True
                return scan
            scan.calls.append(call)
            if not call.complete:
                scan.malformed = final
                return scan
        if scan.calls:
            scan.trailing = "".join(outside).lstrip()
        else:
            scan.content = "".join(outside)
        return scan

    @staticmethod
    def _call(text: str, body: int, final: bool, name: str) -> tuple[PartialCall | None, int]:
        """The call whose body starts at `body`, and where the text after it starts. The body
        ends at `<|call|>` (or `<|end|>`, or the next header: a model that skipped it)."""
        ends = [i for i in (text.find(CALL, body), text.find(END, body), _next_header(text, body))
                if i is not None and i != -1]
        whole = bool(ends) or final
        end = min(ends) if ends else len(text) - (0 if final else max(held_back(text, m) for m in _BODY_ENDS))
        call = json_arguments(text[:end], body, whole, PartialCall(name))
        if call is None:
            return None, end
        call.complete = whole
        closing = next((m for m in (CALL, END) if text.startswith(m, end)), "")
        return call, end + len(closing)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        calls = one_of([sequence(self.literal(CHANNEL), const(f"commentary to=functions.{tool.name} "),
                                 self.literal(CONSTRAIN), const("json"), self.literal(MESSAGE),
                                 json_value(tool.parameters), self.literal(CALL)) for tool in tools])
        if not parallel:
            return calls
        again = sequence(self.literal(START), const("assistant"), calls)
        return sequence(calls, {"type": "star", "content": again})

    def render(self, calls: Sequence[ToolCall]) -> str:
        return f"{START}assistant".join(
            f"{CHANNEL}commentary to=functions.{call.name} {CONSTRAIN}json{MESSAGE}{call.arguments}{CALL}"
            for call in calls)

    def instructions(self) -> str:
        return (f"To call a function, answer with {CHANNEL}commentary to=functions.<function name> {CONSTRAIN}json"
                f"{MESSAGE}<arguments object>{CALL}. To answer without calling a function, answer in plain text.")


def _next_header(text: str, start: int) -> int | None:
    """Where the next message header begins at or after `start`, or None."""
    found = [i for i in (text.find(marker, start) for marker in _HEADER_STARTS) if i != -1]
    return min(found) if found else None
