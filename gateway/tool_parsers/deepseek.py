"""DeepSeek-V3 / R1 (`deepseek_v3`) and DeepSeek-V3.1 (`deepseek_v31`): the calls in one
section of DeepSeek's marker tokens (full-width bars, `▁` for spaces), each its type and name
and the arguments in a json fence (V3, R1)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

or its name and the bare arguments (V3.1)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Both parsers read both forms (what follows the separator tells which: a `{` is V3.1's); each
writes and requires its own. A template shows which: V3's and R1's teach the json fence.
The templates join the arguments as text (`+ arguments`) where DeepSeek's own do: the
conversation then carries them as JSON text."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence

from .base import PartialCall, ToolCall, ToolSpec
from .grammar import const, json_value, one_of, sequence
from .registry import register
from .sections import SectionCalls, json_arguments

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE, FENCE_END = "```json\n", "\n```"
_TYPE = "function"
# a template that joins a call's arguments as text rather than through tojson
_JOINS_ARGUMENTS = re.compile(r"""arguments['"]?\]?\s*\+""")


class DeepSeekToolParser(SectionCalls):
    """What the two DeepSeek formats share; `fenced` says which one is written."""

    section_begin, section_end, call_begin, call_end = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END
    special_markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    fenced: bool

    def read_call(self, body: str, whole: bool) -> PartialCall | None:
        sep = body.find(SEP)
        if sep == -1:
            return None if whole else PartialCall()
        head, i = body[:sep].strip(), sep + len(SEP)
        rest = body[i:].lstrip()
        if not rest:
            return None if whole else PartialCall()
        if rest[0] == "{":  # V3.1: the name, then the arguments
            return json_arguments(body, i, whole, PartialCall(head)) if head else None
        return self._fenced(body, i, whole) if head == _TYPE else None

    @staticmethod
    def _fenced(body: str, i: int, whole: bool) -> PartialCall | None:
        """V3's `name\\n```json\\n{...}\\n```` from `body[i]`."""
        newline = body.find("\n", i)
        if newline == -1:
            return None if whole else PartialCall()
        name = body[i:newline].strip()
        if not name:
            return None
        call = PartialCall(name)
        opening = body[newline + 1:newline + 1 + len("```json")]
        if opening != "```json":
            return None if whole or not "```json".startswith(opening) else call
        return json_arguments(body, newline + 1 + len("```json"), whole, call, closing="```")

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        if self.fenced:
            calls = [sequence(self.literal(CALL_BEGIN), const(_TYPE), self.literal(SEP),
                              const(tool.name + "\n" + FENCE), json_value(tool.parameters), const(FENCE_END),
                              self.literal(CALL_END)) for tool in tools]
        else:
            calls = [sequence(self.literal(CALL_BEGIN), const(tool.name), self.literal(SEP),
                              json_value(tool.parameters), self.literal(CALL_END)) for tool in tools]
        one = one_of(calls)
        if parallel:
            again = sequence(const("\n"), one) if self.fenced else one
            one = sequence(one, {"type": "star", "content": again})
        return sequence(self.literal(CALLS_BEGIN), one, self.literal(CALLS_END))

    def render(self, calls: Sequence[ToolCall]) -> str:
        if self.fenced:
            written = "\n".join(f"{CALL_BEGIN}{_TYPE}{SEP}{call.name}\n{FENCE}{call.arguments}{FENCE_END}{CALL_END}"
                                for call in calls)
        else:
            written = "".join(f"{CALL_BEGIN}{call.name}{SEP}{call.arguments}{CALL_END}" for call in calls)
        return CALLS_BEGIN + written + CALLS_END

    def instructions(self) -> str:
        if self.fenced:
            call = f"{CALL_BEGIN}{_TYPE}{SEP}<function name>\n{FENCE}<arguments object>{FENCE_END}{CALL_END}"
        else:
            call = f"{CALL_BEGIN}<function name>{SEP}<arguments object>{CALL_END}"
        return (f"To call functions, answer with {CALLS_BEGIN}{call}{CALLS_END}, one {CALL_BEGIN}...{CALL_END} per "
                "call. To answer without calling a function, answer in plain text.")

    def prepare_messages(self, messages: list[dict]) -> list[dict]:
        """Earlier calls' arguments as JSON text, for templates that join them as text."""
        if not _JOINS_ARGUMENTS.search(self.context.template):
            return messages
        out = []
        for message in messages:
            if message.get("tool_calls"):
                message = {**message, "tool_calls": [_arguments_as_text(call) for call in message["tool_calls"]]}
            out.append(message)
        return out


def _arguments_as_text(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        return call
    return {**call, "function": {**function, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _fenced_template(template: str) -> bool:
    return "```json" in template


@register
class DeepSeekV3ToolParser(DeepSeekToolParser):
    name = "deepseek_v3"
    fenced = True

    @classmethod
    def detects(cls, template: str) -> bool:
        return CALLS_BEGIN in template and _fenced_template(template)


@register
class DeepSeekV31ToolParser(DeepSeekToolParser):
    name = "deepseek_v31"
    fenced = False

    @classmethod
    def detects(cls, template: str) -> bool:
        return CALLS_BEGIN in template and not _fenced_template(template)
