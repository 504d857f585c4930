"""What a grammar backend would get wrong in a JSON Schema, settled before it compiles.

A backend that drops a keyword (xgrammar ignores `not`; outlines-core ignores numeric
bounds) compiles the schema anyway, and the output then need not satisfy it. Such a
schema is refused with a GrammarError naming the keyword and where it stands, so the
client learns at once instead of getting JSON that fails its own validation.

A backend whose regex for a `format` is looser than the format itself (both accept the
IPv4 address "192.08.0.1" and the date "2023-02-31"; outlines' date-time needs no UTC
offset) is given the exact pattern instead: `strict_formats` rewrites those formats.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from .spec import GrammarError, GrammarSpec
from .structural import nested_schemas

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


_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_YEAR = r"([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999, as ISO dates allow
_DATE = (rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         rf"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
# format -> the pattern that matches exactly its valid strings (RFC 3339 for dates and times)
STRICT_FORMATS = {
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "date": rf"^{_DATE}$",
    "time": rf"^{_TIME}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
}


def strict_formats(spec: GrammarSpec) -> str:
    """`spec`'s schema text with each loosely compiled `format` (STRICT_FORMATS) replaced
    by its exact `pattern`; a schema that already has a pattern keeps both as they are."""
    schema = json.loads(spec.value)
    changed = False
    for _, sub in _subschemas(schema, "#"):
        pattern = STRICT_FORMATS.get(sub.get("format")) if isinstance(sub.get("format"), str) else None
        if pattern is not None and "pattern" not in sub:
            del sub["format"]
            sub["pattern"] = pattern
            changed = True
    return json.dumps(schema, separators=(",", ":")) if changed else spec.value


def check_schema_support(spec: GrammarSpec, unsupported: Unsupported, backend: str) -> None:
    """Raise GrammarError at the first keyword of `spec`'s schema (or of the schemas a structural
    spec holds) that `backend` would ignore."""
    for nested in nested_schemas(spec):
        for path, schema in _subschemas(nested.schema, "#"):
            for keyword, applies in unsupported.items():
                if keyword in schema and (applies is None or applies(schema[keyword], schema)):
                    raise GrammarError(f"JSON schema keyword {keyword!r} (at {path}) is not supported by the "
                                       f"{backend} grammar backend",
                                       "tools" if spec.kind == "structural" else "response_format")


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
