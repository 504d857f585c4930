"""Structured output, in no dialect: what a request asks its output to be (a JSON
schema, any JSON object, a regex, one of some strings) -> a checked `GrammarSpec`.

Checked twice. At the edge: a schema for its depth (at most MAX_SCHEMA_DEPTH levels) and
for references outside itself (refused: nothing is ever fetched, and a backend would leave
them unconstrained), then against JSON Schema's 2020-12 meta-schema; a regex by Python's `re`. Then by the engine's compile (`compiled`), which knows what
its backend supports (a schema feature it lacks, a regex construct it cannot turn
into an automaton, a compile past its time limit). Either failure is a VALIDATION
error naming the request's param: a 400 on OpenAI routes, a 422 on TGI's. A compile the
server could not run (GrammarUnavailable: no worker started in time) is a 503 instead.
"""
from __future__ import annotations

import json
import re

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from switchyard.core.errors import EngineDeadError
from switchyard.core.grammar import GrammarError, GrammarSpec, GrammarUnavailable

from .errors import ErrorKind, GatewayError, invalid
from .settings import ServerSettings
from .tracing import child_span

# characters with a meaning in a regex; everything else stands for itself (re.escape
# also escapes spaces and other characters that some regex engines reject escaped)
_REGEX_SPECIAL = frozenset("\\.^$*+?()[]{}|/")
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in a schema (deeper overflows the meta-schema check)
_REF_KEYWORDS = ("$ref", "$dynamicRef")


def check_enabled(settings: ServerSettings, param: str) -> None:
    """--disable-grammar-support: everything that needs a grammar is refused, as TGI does."""
    if settings.disable_grammar_support:
        raise invalid(f"grammar is not supported: this server runs with --disable-grammar-support, "
                      f"so `{param}` cannot be honoured", param)


def checked_schema(schema, param: str) -> dict | bool:
    """A JSON schema (an object, a boolean, or its JSON text) that is valid under draft 2020-12."""
    if isinstance(schema, str):  # TGI and vLLM accept the schema as JSON text
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise invalid(f"the JSON schema is not valid JSON: {exc}", param) from exc
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"a JSON schema must be an object, not {type(schema).__name__}", param)
    _check_shape(schema, param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise invalid(f"invalid JSON schema{f' at {where!r}' if where else ''}: {exc.message}", param) from exc
    return schema


def _check_shape(schema, param: str) -> None:
    """Depth and references, walked without recursion (a deep schema must not overflow here)."""
    stack = [(schema, (), 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise invalid(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep "
                          f"(at {_pointer(path[:MAX_SCHEMA_DEPTH + 1])})", param)
        if isinstance(node, dict):
            for keyword in _REF_KEYWORDS:
                ref = node.get(keyword)
                if isinstance(ref, str) and not ref.startswith("#"):
                    raise invalid(f"the JSON schema's {keyword} {ref!r} (at {_pointer(path)}) is not local: only "
                                  "references inside the schema (\"#...\") are supported", param)
            stack.extend((value, (*path, key), depth + 1) for key, value in node.items())
        elif isinstance(node, list):
            stack.extend((value, (*path, i), depth + 1) for i, value in enumerate(node))


def _pointer(path: tuple) -> str:
    return "#" + "".join(f"/{p}" for p in path)


def schema_spec(schema, param: str) -> GrammarSpec:
    return GrammarSpec.json_schema(checked_schema(schema, param))


def regex_spec(pattern, param: str) -> GrammarSpec:
    if not isinstance(pattern, str) or not pattern:
        raise invalid("the regex must be a non-empty string", param)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise invalid(f"invalid regex {pattern!r}: {exc}", param) from exc
    return GrammarSpec.regex(pattern)


def choice_spec(choices, param: str) -> GrammarSpec:
    """The output is exactly one of `choices` (vLLM's guided_choice): a regex of alternatives."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise invalid("the choices must be a non-empty list of non-empty strings", param)
    return GrammarSpec.regex("(" + "|".join(_escape(c) for c in choices) + ")")


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


def tgi_grammar_spec(kind: str, value, param: str) -> GrammarSpec:
    """TGI's `{"type", "value"}` grammar: `json` (alias `json_object`) carries a schema
    (or its JSON text), `json_schema` carries `{"name"?, "schema"}`, `regex` a pattern."""
    if kind in ("json", "json_object"):
        if value is None:
            raise invalid(f"a grammar of type {kind!r} needs a JSON schema as its `value`", param)
        return schema_spec(value, param)
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise invalid("a grammar of type 'json_schema' needs a `value` of the form {\"name\", \"schema\"}", param)
        return schema_spec(value["schema"], param)
    if kind == "regex":
        return regex_spec(value, param)
    raise invalid(f"unknown grammar type {kind!r}: expected 'json', 'json_object', 'json_schema' or 'regex'", param)


async def compiled(client, spec: GrammarSpec, param: str) -> GrammarSpec:
    """Compile `spec` before the request is submitted, so that a grammar the engine
    cannot honour is a synchronous 4xx naming `param` rather than a failed stream; one
    the server could not compile just now (no worker started, the engine stopping) is a
    503 with Retry-After, which blames nothing in the request."""
    try:
        with child_span("grammar_compile", kind=spec.kind):
            await client.compile_grammar(spec)
    except GrammarUnavailable as exc:
        raise GatewayError(ErrorKind.UNAVAILABLE, str(exc)) from exc
    except GrammarError as exc:
        raise invalid(str(exc), param) from exc
    except EngineDeadError as exc:
        raise GatewayError(ErrorKind.UNAVAILABLE, str(exc)) from exc
    return spec
