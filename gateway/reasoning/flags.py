"""`switchyard serve --reasoning-parser` (vLLM's and SGLang's flag; env REASONING_PARSER):
`auto` (the default: from the chat template, select.py), `none`, or a format of formats.py.
Checked when the command line is parsed; the value becomes ServerSettings.reasoning_parser."""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from .select import AUTO, CHOICES, parser_name


def add_reasoning_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument("--reasoning-parser", default=environ.get("REASONING_PARSER") or AUTO,
                        help="how a reasoning model's thinking is told from its answer, which then come back apart "
                        "(chat `reasoning_content`, Responses reasoning items, Anthropic thinking blocks) and "
                        f"grammars constrain the answer only: {', '.join(CHOICES)} (default auto: the one the chat "
                        "template names unambiguously, else none) [env: REASONING_PARSER]")


def reasoning_parser(args: argparse.Namespace) -> str:
    """The canonical parser name, or ValidationError (a one-line user error)."""
    return parser_name(args.reasoning_parser)
