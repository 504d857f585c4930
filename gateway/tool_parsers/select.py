"""Which tool-call format a served model speaks, decided here once per request from
`--tool-call-parser` and the model's chat template and tokenizer.

`--tool-call-parser auto` (the default) takes the parser whose format the chat template shows,
when exactly one does; `json` (or a template that shows none, or several) keeps the format this
server used before parsers: the calls as JSON objects, a grammar of that JSON for `required` and
named choices (gateway/openai/tools.py)."""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from switchyard.core.params import ValidationError

from .base import FormatContext, ToolParser, ToolSpec
from .registry import detect_parser, get_parser, parser_names

AUTO = "auto"
NO_FORMAT = "json"
logger = logging.getLogger("switchyard.gateway.tool_parsers")


def parser_choices() -> tuple[str, ...]:
    """What --tool-call-parser takes."""
    return (AUTO, NO_FORMAT, *parser_names())


@dataclass(frozen=True)
class ToolFormat:
    """A parser class and what it knows of the served model; `for_tools` makes the parser
    of one request."""

    parser: type[ToolParser]
    context: FormatContext

    @property
    def name(self) -> str:
        return self.parser.name

    def for_tools(self, tools: Sequence[ToolSpec]) -> ToolParser:
        return self.parser(tools, self.context)


def served_tool_format(service) -> ToolFormat | None:
    """The tool-call format of the model `service` serves, under its --tool-call-parser."""
    return tool_format(service.settings.tool_call_parser, service.tokenizer)


def parser_name(value: str) -> str:
    """The canonical name of a --tool-call-parser value; ValidationError for an unknown one
    (vLLM's spellings with dashes are accepted)."""
    name = value.strip().lower().replace("-", "_")
    if name not in parser_choices():
        raise ValidationError(f"--tool-call-parser must be one of {', '.join(parser_choices())}; got {value!r}")
    return name


def tool_format(choice: str, tokenizer) -> ToolFormat | None:
    """The format of `--tool-call-parser` `choice` for the model of `tokenizer`, or None for
    the JSON format without a parser."""
    template = template_text(getattr(tokenizer, "chat_template", None))
    parser = _chosen(choice, template)
    if parser is None:
        return None
    return ToolFormat(parser, FormatContext(template, special_texts(tokenizer)))


@functools.lru_cache(maxsize=32)
def _chosen(choice: str, template: str) -> type[ToolParser] | None:
    if choice == NO_FORMAT:
        return None
    if choice != AUTO:
        return get_parser(choice)
    parser = detect_parser(template)
    if parser is not None:
        logger.info("tool-call parser: %s (from the chat template)", parser.name)
    elif template and sum(candidate.detects(template) for candidate in map(get_parser, parser_names())) > 1:
        logger.warning("the chat template shows several tool-call formats: tool calls are read as JSON; "
                       "choose one with --tool-call-parser")
    return parser


def template_text(template: str | dict | None) -> str:
    """A chat template's text; a tokenizer's named templates all together."""
    if isinstance(template, dict):
        return "\n".join(str(text) for text in template.values())
    return template or ""


@functools.lru_cache(maxsize=8)
def special_texts(tokenizer) -> frozenset[str]:
    """The texts of the tokenizer's special tokens: those skip_special_tokens drops."""
    texts = set()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    added = backend.get_added_tokens_decoder() if hasattr(backend, "get_added_tokens_decoder") else \
        getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts.update(token.content for token in added.values() if getattr(token, "special", False))
    ids = list(getattr(tokenizer, "all_special_ids", ()) or ())
    if ids and hasattr(tokenizer, "convert_ids_to_tokens"):
        texts.update(text for text in tokenizer.convert_ids_to_tokens(ids) if text)
    return frozenset(texts)
