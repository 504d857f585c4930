"""Kimi K2: the calls in one section, each its id (`functions.NAME:INDEX`, the index counting
the calls of the conversation) and its arguments as JSON:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The id the model writes is the call's id (as vLLM answers; `ToolCall.call_id`), and Kimi's
template writes each earlier call's id back: ids of another shape in a conversation (ours are
`call_...`) become `functions.NAME:INDEX`, and the tool results that name them follow."""
from __future__ import annotations

import re
from collections.abc import Sequence

from .base import PartialCall, ToolCall, ToolSpec
from .grammar import const, json_value, one_of, repeated, sequence
from .registry import register
from .sections import SectionCalls, json_arguments

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENTS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_PREFIX = "functions."
_ID = re.compile(r"\s*((?:functions\.)?(.+):(\d+))\s*", re.DOTALL)
_OUR_SHAPE = re.compile(r"functions\..+:\d+")


@register
class KimiK2ToolParser(SectionCalls):
    name = "kimi_k2"
    section_begin, section_end, call_begin, call_end = SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END
    special_markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENTS, CALL_END)

    @classmethod
    def detects(cls, template: str) -> bool:
        return SECTION_BEGIN in template

    def read_call(self, body: str, whole: bool) -> PartialCall | None:
        at = body.find(ARGUMENTS)
        if at == -1:
            return None if whole else PartialCall()
        written = _ID.fullmatch(body[:at])
        if written is None:
            return None
        call = PartialCall(written.group(2), call_id=written.group(1))
        return json_arguments(body, at + len(ARGUMENTS), whole, call)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        calls = [sequence(self.literal(CALL_BEGIN), const(f"{_PREFIX}{tool.name}:"), {"type": "regex",
                          "pattern": "[0-9]+"}, self.literal(ARGUMENTS), json_value(tool.parameters),
                          self.literal(CALL_END)) for tool in tools]
        return sequence(self.literal(SECTION_BEGIN), repeated(one_of(calls), "", parallel), self.literal(SECTION_END))

    def render(self, calls: Sequence[ToolCall]) -> str:
        return SECTION_BEGIN + "".join(
            f"{CALL_BEGIN}{call.call_id or f'{_PREFIX}{call.name}:{index}'}{ARGUMENTS}{call.arguments}{CALL_END}"
            for index, call in enumerate(calls)) + SECTION_END

    def instructions(self) -> str:
        return (f"To call functions, answer with {SECTION_BEGIN}{CALL_BEGIN}{_PREFIX}<function name>:<call number>"
                f"{ARGUMENTS}<arguments object>{CALL_END}{SECTION_END}, one {CALL_BEGIN}...{CALL_END} per call. To "
                "answer without calling a function, answer in plain text.")

    def prepare_messages(self, messages: list[dict]) -> list[dict]:
        """Earlier calls' ids as Kimi writes them; the tool results that name them follow."""
        renamed: dict[str, str] = {}
        count = 0
        out = []
        for message in messages:
            if message.get("tool_calls"):
                calls = []
                for call in message["tool_calls"]:
                    old = call.get("id") or ""
                    new = old if _OUR_SHAPE.fullmatch(old) else f"{_PREFIX}{call['function']['name']}:{count}"
                    renamed[old] = new
                    calls.append({**call, "id": new})
                    count += 1
                message = {**message, "tool_calls": calls}
            elif message.get("role") == "tool" and message.get("tool_call_id") in renamed:
                message = {**message, "tool_call_id": renamed[message["tool_call_id"]]}
            out.append(message)
        return out
