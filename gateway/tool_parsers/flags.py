"""`switchyard serve --tool-call-parser` (vLLM's flag; env TOOL_CALL_PARSER): `auto` (the
default: the format the chat template shows, select.py), `json` (the calls as JSON, no
parser), or a parser of the registry. vLLM's `--enable-auto-tool-choice` is accepted: here
`tool_choice: auto` is always served. Checked when the command line is parsed; the value
becomes ServerSettings.tool_call_parser."""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from .select import AUTO, parser_choices, parser_name


def add_tool_parser_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument("--tool-call-parser", default=environ.get("TOOL_CALL_PARSER") or AUTO,
                        help="the format a model writes tool calls in, read from its answers (whole and streamed) and "
                        "required by a grammar in that format for tool_choice required or named: "
                        f"{', '.join(parser_choices())} (default auto: the one the chat template shows unambiguously, "
                        "else json) [env: TOOL_CALL_PARSER]")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice auto is always served")


def tool_call_parser(args: argparse.Namespace) -> str:
    """The canonical parser name, or ValidationError (a one-line user error)."""
    return parser_name(args.tool_call_parser)
