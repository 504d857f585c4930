"""The tool-call parsers by name (`--tool-call-parser`), as vLLM's ToolParserManager keeps
them, and the one a chat template shows (auto selection)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import ToolParser

_PARSERS: dict[str, type[ToolParser]] = {}


def register(parser: type[ToolParser]) -> type[ToolParser]:
    """Class decorator: the parser under its `name`."""
    if parser.name in _PARSERS:
        raise ValueError(f"a tool-call parser named {parser.name!r} is already registered")
    _PARSERS[parser.name] = parser
    return parser


def parser_names() -> tuple[str, ...]:
    return tuple(sorted(_PARSERS))


def get_parser(name: str) -> type[ToolParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise KeyError(f"no tool-call parser named {name!r}; known: {', '.join(parser_names())}") from None


def detect_parser(template: str) -> type[ToolParser] | None:
    """The parser whose format `template` shows, when exactly one does; None when none or
    several do (then the format is not guessed)."""
    found = [parser for parser in _PARSERS.values() if template and parser.detects(template)]
    return found[0] if len(found) == 1 else None
