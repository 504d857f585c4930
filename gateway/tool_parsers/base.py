"""What a tool-call parser is: one model family's way of writing tool calls, read from its
output (whole or as it grows), written back (earlier calls in a prompt), described (a
system prompt's instructions) and required (a grammar in that format).

A parser reads text only; which calls are valid (known names, arguments that are a JSON
object) is decided once, in stream.py's `validated`. Wire shapes are the dialects' own
(gateway/openai/parsed_tool_output.py)."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol


class ToolSpec(Protocol):
    """A tool as a parser needs it (gateway/openai/tools.py's Tool)."""

    name: str
    parameters: dict  # the JSON schema of its arguments object


@dataclass(frozen=True)
class ToolCall:
    """A call read from an output, or to be written into a prompt."""

    name: str
    arguments: str  # JSON text of an object
    call_id: str | None = None  # the id the model wrote for it, in formats that write one (Kimi K2's)


@dataclass
class PartialCall:
    """A call as far as it has been read. `arguments` is JSON text that only ever grows (the
    model's own text for JSON formats, built from each finished parameter for the others)."""

    name: str | None = None  # known once it is complete
    arguments: str = ""
    complete: bool = False  # the call's end has been read
    call_id: str | None = None  # the id the model wrote, where its format has one


@dataclass
class Scan:
    """An output read by a parser: the text before the first call, the calls begun, the
    text after them. `malformed`: the text holds something that starts a call but is none."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)
    trailing: str = ""
    malformed: bool = False


@dataclass(frozen=True)
class FormatContext:
    """What a parser learns from the served model: its chat template's text, and which
    texts are special tokens of its tokenizer (such a marker must be required as a token,
    and is dropped from the text unless special tokens are kept)."""

    template: str = ""
    special_texts: frozenset[str] = frozenset()


class ToolParser(ABC):
    """One format. A subclass names itself, says which templates are its own, and reads,
    writes and constrains calls. An instance serves one request (its tools)."""

    name: ClassVar[str]
    # texts that are tokens in the models of this family and must stay in the output text
    special_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Sequence[ToolSpec], context: FormatContext = FormatContext()):
        self.tools = tuple(tools)
        self.context = context

    @classmethod
    @abstractmethod
    def detects(cls, template: str) -> bool:
        """Whether a chat template's text shows this format (auto selection, registry.py)."""

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The output `text` read so far (`final`: it is whole). Text that may still become a
        call (a marker's first characters) is in neither content nor calls until it is known."""

    @abstractmethod
    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> dict:
        """A structural grammar (core/grammar/structural.py) of one call of one of `tools` in this
        format, or one or more of them when `parallel`: what `tool_choice` required or named forces."""

    @abstractmethod
    def render(self, calls: Sequence[ToolCall]) -> str:
        """`calls` as this format writes them (an earlier turn's calls, for templates that do
        not render them)."""

    @abstractmethod
    def instructions(self) -> str:
        """How to call a function in this format, for a system prompt (templates that do not
        render tools)."""

    def prepare_messages(self, messages: list[dict]) -> list[dict]:
        """The conversation as this family's template expects it (default: as it is)."""
        return messages

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether this format's markers are special tokens of the served tokenizer: they are
        then kept in the output text (skip_special_tokens off) for the parser to see."""
        return any(marker in self.context.special_texts for marker in self.special_markers)

    def literal(self, text: str) -> dict:
        """A marker in a grammar: the special token itself where it is one, else its text."""
        if text in self.context.special_texts:
            return {"type": "token", "token": text}
        return {"type": "const_string", "value": text}

    def tool(self, name: str) -> ToolSpec | None:
        return next((tool for tool in self.tools if tool.name == name), None)


def split_at_marker(text: str, marker: str, final: bool, start: int = 0) -> tuple[str, int | None]:
    """(the text from `start` before `marker`, the marker's index or None). Unless `final`, a
    text ending in the marker's first characters keeps them back (they may begin it)."""
    index = text.find(marker, start)
    if index != -1:
        return text[start:index], index
    return text[start:len(text) - (0 if final else held_back(text, marker))], None


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` are the first characters of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def arguments_text(value) -> str:
    """Arguments as the JSON text a call carries."""
    return json.dumps(value, ensure_ascii=False)
