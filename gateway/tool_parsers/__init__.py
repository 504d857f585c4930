"""Tool calls in a model's own format (vLLM's --tool-call-parser): one parser class per
format, registered by name (registry.py), chosen from --tool-call-parser or the chat
template (select.py), read whole or as a stream (stream.py), required by a grammar in the
same format (each parser's `grammar`, core/grammar/structural.py).

The parsers: hermes, llama3_json, mistral, pythonic, qwen3_coder, deepseek_v3 and deepseek_v31
(deepseek.py), kimi_k2, glm45, openai (gpt-oss's harmony, harmony.py)."""
from __future__ import annotations

# each module registers its parsers
from . import (deepseek, glm45, harmony, hermes, kimi_k2, llama3_json, mistral, pythonic,  # noqa: F401
               qwen3_coder)  # noqa: F401
from .base import FormatContext, PartialCall, Scan, ToolCall, ToolParser
from .registry import detect_parser, get_parser, parser_names, register
from .select import (AUTO, NO_FORMAT, ToolFormat, parser_choices, parser_name, served_tool_format, special_texts,
                     template_text, tool_format)
from .stream import CallStream, ParsedOutput, parse_output, validated

__all__ = ["AUTO", "NO_FORMAT", "CallStream", "FormatContext", "ParsedOutput", "PartialCall", "Scan", "ToolCall",
           "ToolFormat", "ToolParser", "detect_parser", "get_parser", "parse_output", "parser_choices",
           "parser_name", "parser_names", "register", "served_tool_format", "special_texts", "template_text",
           "tool_format", "validated"]
