"""Pieces of the structural grammars the parsers build (core/grammar/structural.py's nodes),
and the JSON schema of a call object that wraps a tool's parameters."""
from __future__ import annotations

from collections.abc import Sequence


def const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def json_value(schema: dict | bool, style: str = "json") -> dict:
    node = {"type": "json_schema", "json_schema": schema}
    return node if style == "json" else {**node, "style": style}


def sequence(*elements: dict) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": list(elements)}


def one_of(elements: Sequence[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": list(elements)}


def optional(node: dict) -> dict:
    return {"type": "optional", "content": node}


def repeated(item: dict, separator: str, parallel: bool) -> dict:
    """`item`, or one or more of them between `separator`s when `parallel`."""
    if not parallel:
        return item
    again = sequence(const(separator), item) if separator else item
    return sequence(item, {"type": "star", "content": again})


def call_object(name: str, key: str, parameters: dict, where: str = "#") -> dict:
    """`{"name": <name>, <key>: <parameters>}`, name first (generation follows the schema's
    property order). Local references in the parameters are rebased to where they now stand:
    under `key` of this object, itself at `where` of its root schema."""
    return {"type": "object",
            "properties": {"name": {"const": name}, key: rebased(parameters, f"{where}/properties/{key}")},
            "required": ["name", key], "additionalProperties": False}


def rebased(node, base: str):
    """A copy of `node` with each local `$ref` "#<pointer>" made "<base><pointer>", for a schema
    moved from a root to `base`."""
    if isinstance(node, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebased(v, base)
                for k, v in node.items()}
    if isinstance(node, list):
        return [rebased(v, base) for v in node]
    return node


def property_schema(parameters: dict, key: str) -> dict | bool:
    """One property's schema as a root of its own: the parameters' `$defs` come along, so that
    references into them still resolve."""
    schema = parameters.get("properties", {}).get(key, True)
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    if not defs or not isinstance(schema, dict):
        return schema
    return {**schema, **defs}
