"""JSON Schema keywords a grammar backend would silently ignore, refused up front.

A backend that drops a keyword (xgrammar ignores `not`; outlines-core ignores numeric
bounds) compiles the schema anyway, and the output then need not satisfy it. Such a
schema is refused with a GrammarError naming the keyword and where it stands, so the
client learns at once instead of getting JSON that fails its own validation.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from .spec import GrammarError, GrammarSpec

# keyword -> when its value makes it unsupported (None: always)
Unsupported = dict[str, Callable[[object, dict], bool] | None]

_BY_NAME = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems")

_ALWAYS_IGNORED: Unsupported = {name: None for name in (
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains", "minContains",
    "maxContains")}
_ALWAYS_IGNORED["uniqueItems"] = lambda value, schema: value is True

XGRAMMAR_UNSUPPORTED: Unsupported = {
    **_ALWAYS_IGNORED,
    "allOf": lambda value, schema: isinstance(value, list) and len(value) > 1,
    # xgrammar drops string lengths next to a pattern or a format
    "minLength": lambda value, schema: "pattern" in schema or "format" in schema,
    "maxLength": lambda value, schema: "pattern" in schema or "format" in schema,
}

OUTLINES_UNSUPPORTED: Unsupported = {
    **_ALWAYS_IGNORED,
    **{name: None for name in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                               "minProperties", "maxProperties", "propertyNames")},
}


def check_schema_support(spec: GrammarSpec, unsupported: Unsupported, backend: str) -> None:
    """Raise GrammarError at the first keyword of `spec`'s schema that `backend` would ignore."""
    if spec.kind != "json_schema":
        return
    for path, schema in _subschemas(spec.schema, "#"):
        for keyword, applies in unsupported.items():
            if keyword in schema and (applies is None or applies(schema[keyword], schema)):
                raise GrammarError(f"JSON schema keyword {keyword!r} (at {path}) is not supported by the "
                                   f"{backend} grammar backend", "response_format")


def _subschemas(schema, path: str) -> Iterator[tuple[str, dict]]:
    """Every schema object in `schema` with its JSON-pointer-like path (property names
    and enum values are never mistaken for keywords)."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key, value in schema.items():
        if key in _BY_NAME and isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, f"{path}/{key}/{name}")
        elif key in _ONE:
            yield from _subschemas(value, f"{path}/{key}")
        elif key in _MANY and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _subschemas(sub, f"{path}/{key}/{i}")
