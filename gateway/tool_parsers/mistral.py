"""Mistral: calls after the `[TOOL_CALLS]` token, as a JSON list (tokenizers before v11)

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

or, from v11 on (Mistral Small 3.2, Magistral, Devstral), each call as its name, the `[ARGS]`
token and its arguments:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

Both are read whichever the model writes; a grammar requires the one its template shows
(`[ARGS]` in it: the newer). The markers are special tokens in Mistral's tokenizers, so
they are kept in the output text (skip_special_tokens off, base.py) and required as tokens.
Mistral's templates take tool call ids of 9 letters and digits only: longer ids in a
conversation are cut to their last 9."""
from __future__ import annotations

import json
from collections.abc import Sequence

from .base import PartialCall, Scan, ToolCall, ToolParser, ToolSpec, held_back, split_at_marker
from .grammar import call_object, const, json_value, one_of, repeated, sequence
from .json_scan import NotJSON, arguments_of, name_of, scan_object, skip_space, value_end
from .registry import register

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_LENGTH = 9


@register
class MistralToolParser(ToolParser):
    name = "mistral"
    special_markers = (TOOL_CALLS, ARGS)

    @classmethod
    def detects(cls, template: str) -> bool:
        return TOOL_CALLS in template

    @property
    def named_arguments(self) -> bool:
        """Whether this model writes `name[ARGS]{...}` (its template shows [ARGS])."""
        return ARGS in self.context.template

    def scan(self, text: str, final: bool) -> Scan:
        content, index = split_at_marker(text, TOOL_CALLS, final)
        scan = Scan(content=content)
        if index is None:
            return scan
        i = skip_space(text, index + len(TOOL_CALLS))
        try:
            if i >= len(text):
                scan.malformed = final
            elif text[i] in "[{":
                self._json_calls(text, i, final, scan)
            else:
                self._named_calls(text, i, final, scan)
        except (NotJSON, json.JSONDecodeError):
            scan.malformed = True
        return scan

    def _json_calls(self, text: str, i: int, final: bool, scan: Scan) -> None:
        """A JSON list of call objects (or one object)."""
        listed = text[i] == "["
        j = skip_space(text, i + 1) if listed else i
        while j < len(text):
            if listed and text[j] == "]" and scan.calls:
                scan.trailing = text[j + 1:].lstrip()
                return
            obj = scan_object(text, j, final)
            closed = obj.end is not None
            scan.calls.append(PartialCall(name_of(text, obj.member("name")),
                                          arguments_of(text, obj.member("arguments", "parameters"), closed), closed))
            if not closed:
                break
            j = skip_space(text, obj.end)
            if not listed:
                scan.trailing = text[j:]
                return
            if j < len(text) and text[j] == ",":
                j = skip_space(text, j + 1)
            elif j < len(text) and text[j] != "]":
                raise NotJSON("calls in a list are separated by ,")
        scan.malformed = final

    def _named_calls(self, text: str, i: int, final: bool, scan: Scan) -> None:
        """`name[ARGS]{...}`, each after its own [TOOL_CALLS]."""
        while True:
            name, args_index = split_at_marker(text, ARGS, final, i)
            if args_index is None:
                scan.calls.append(PartialCall())
                scan.malformed = final
                return
            start = skip_space(text, args_index + len(ARGS))
            if start < len(text) and text[start] != "{":
                raise NotJSON("arguments are an object")
            end = value_end(text, start, final) if start < len(text) else None
            scan.calls.append(PartialCall(name.strip(), text[start:end if end is not None else len(text)],
                                          end is not None))
            if end is None:
                scan.malformed = final
                return
            j = skip_space(text, end)
            if text.startswith(TOOL_CALLS, j):
                i = skip_space(text, j + len(TOOL_CALLS))
                continue
            if not final and held_back(text[j:], TOOL_CALLS) == len(text) - j:
                return  # another call may begin
            scan.trailing = text[j:]
            return

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        if self.named_arguments:
            calls = [sequence(const(tool.name), self.literal(ARGS), json_value(tool.parameters)) for tool in tools]
            return repeated(sequence(self.literal(TOOL_CALLS), one_of(calls)), "", parallel)
        if len(tools) == 1:
            item = call_object(tools[0].name, "arguments", tools[0].parameters, "#/items")
        else:
            item = {"anyOf": [call_object(tool.name, "arguments", tool.parameters, f"#/items/anyOf/{i}")
                              for i, tool in enumerate(tools)]}
        listed = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return sequence(self.literal(TOOL_CALLS), json_value(listed))

    def render(self, calls: Sequence[ToolCall]) -> str:
        if self.named_arguments:
            return "".join(f"{TOOL_CALLS}{call.name}{ARGS}{call.arguments}" for call in calls)
        return TOOL_CALLS + json.dumps([{"name": call.name, "arguments": json.loads(call.arguments)}
                                        for call in calls], ensure_ascii=False)

    def instructions(self) -> str:
        if self.named_arguments:
            return (f"To call a function, answer with {TOOL_CALLS}<function name>{ARGS}<arguments object>. To "
                    "answer without calling a function, answer in plain text.")
        return (f'To call functions, answer with {TOOL_CALLS}[{{"name": <function name>, "arguments": <arguments '
                "object>}, ...]. To answer without calling a function, answer in plain text.")

    def prepare_messages(self, messages: list[dict]) -> list[dict]:
        out = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [{**call, "id": short_id(call.get("id"))} for call in message["tool_calls"]]
            if message.get("tool_call_id"):
                message["tool_call_id"] = short_id(message["tool_call_id"])
            out.append(message)
        return out


def short_id(call_id: str | None) -> str:
    """A tool call id as Mistral's templates take it: its last 9 letters and digits."""
    alnum = "".join(ch for ch in call_id or "" if ch.isascii() and ch.isalnum())
    return alnum[-_ID_LENGTH:].rjust(_ID_LENGTH, "0")

