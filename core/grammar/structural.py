"""Structural grammars: an output made of fixed text, special tokens, JSON values of given
schemas and regexes, in sequence, as alternatives or repeated. The gateway builds one for a
tool call in a model's own format (`<tool_call>` + a call's JSON + `</tool_call>`, Mistral's
`[TOOL_CALLS]` token + a JSON list, Qwen3-Coder's and GLM's XML parameters); a `GrammarSpec` of kind
"structural" carries it as JSON.

The tree is a subset of xgrammar's structural-tag format, with its node names:

    {"type": "const_string", "value": str}        that text
    {"type": "token", "token": str}               one special token, by its text (xgrammar only)
    {"type": "json_schema", "json_schema": {...}, "style": "json" | "qwen_xml" | "glm_xml"}
                                                  compact JSON of the schema, or the schema's
                                                  object as `<parameter=key>value</parameter>`
                                                  (qwen_xml) or `<arg_key>key</arg_key>
                                                  <arg_value>value</arg_value>` (glm_xml), the
                                                  XML styles xgrammar's only
    {"type": "regex", "pattern": str}
    {"type": "sequence" | "or", "elements": [node, ...]}
    {"type": "star" | "plus" | "optional", "content": node}

xgrammar compiles it as a structural tag, each JSON schema as the same compact grammar a
`json_schema` spec compiles to; outlines-core as one regex. What a backend cannot express
(a special token or an XML style under outlines-core) is a GrammarError naming the backend.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from .spec import GrammarError, GrammarSpec

_PARAM = "tools"  # structural grammars come from tools; the gateway renames it if need be
_LEAVES = {"const_string": "value", "token": "token", "regex": "pattern"}
_LISTS = ("sequence", "or")
_WRAPS = ("star", "plus", "optional")
_STYLES = ("json", "qwen_xml", "glm_xml")
# characters with a meaning in a regex; everything else stands for itself
_REGEX_SPECIAL = frozenset("\\.^$*+?()[]{}|/-")


def check_structure(node) -> None:
    """Raise GrammarError unless `node` is a well-formed tree of the nodes above."""
    for where, item in walk(node):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind in _LEAVES:
            if not isinstance(item.get(_LEAVES[kind]), str) or not item[_LEAVES[kind]]:
                raise GrammarError(f"structural grammar: {where} needs a non-empty {_LEAVES[kind]!r}", _PARAM)
        elif kind == "json_schema":
            if not isinstance(item.get("json_schema"), (dict, bool)) or item.get("style", "json") not in _STYLES:
                raise GrammarError(f"structural grammar: {where} needs a schema and a style of {_STYLES}", _PARAM)
        elif kind in _LISTS:
            if not isinstance(item.get("elements"), list) or not item["elements"]:
                raise GrammarError(f"structural grammar: {where} needs elements", _PARAM)
        elif kind not in _WRAPS:
            raise GrammarError(f"structural grammar: {where} is not a known node ({kind!r})", _PARAM)


def walk(node, where: str = "#") -> Iterator[tuple[str, dict]]:
    """Every node with its path; children of nodes that are not dicts are not followed."""
    yield where, node
    if not isinstance(node, dict):
        return
    if node.get("type") in _LISTS and isinstance(node.get("elements"), list):
        for i, child in enumerate(node["elements"]):
            yield from walk(child, f"{where}/elements/{i}")
    elif node.get("type") in _WRAPS:
        yield from walk(node.get("content"), f"{where}/content")


def nested_schemas(spec: GrammarSpec) -> list[GrammarSpec]:
    """The JSON schemas a spec holds, each as a json_schema spec: its own schema, or those of
    a structural spec's json_schema nodes (checked and rewritten as any schema is)."""
    if spec.kind == "json_schema":
        return [spec]
    if spec.kind != "structural":
        return []
    return [GrammarSpec.json_schema(node["json_schema"]) for _, node in walk(spec.structure)
            if isinstance(node, dict) and node.get("type") == "json_schema"]


def xgrammar_structural_tag(tree: dict, json_grammar: Callable[[dict | bool], str]) -> str:
    """The tree as xgrammar's structural tag (JSON text): each `json` style schema replaced by
    `json_grammar(schema)`, the EBNF grammar of its compact JSON."""
    def convert(node: dict) -> dict:
        kind = node["type"]
        if kind == "json_schema":
            if node.get("style", "json") == "json":
                return {"type": "grammar", "grammar": json_grammar(node["json_schema"])}
            return {"type": "json_schema", "json_schema": node["json_schema"], "style": node["style"]}
        if kind in _LISTS:
            return {"type": kind, "elements": [convert(child) for child in node["elements"]]}
        if kind in _WRAPS:
            return {"type": kind, "content": convert(node["content"])}
        return dict(node)

    return json.dumps({"type": "structural_tag", "format": convert(tree)})


def regex_of(tree: dict, schema_regex: Callable[[dict | bool], str], backend: str) -> str:
    """The tree as one regex (outlines-core): each JSON schema as `schema_regex(schema)`."""
    kind = tree["type"]
    if kind == "const_string":
        return "".join(_escaped(ch) for ch in tree["value"])
    if kind == "regex":
        return f"({tree['pattern']})"
    if kind == "json_schema":
        if tree.get("style", "json") != "json":
            raise GrammarError(f"tool calls in this model's format ({tree['style']} parameters) need the xgrammar "
                               f"grammar backend, not {backend}", _PARAM)
        return f"({schema_regex(tree['json_schema'])})"
    if kind == "token":
        raise GrammarError(f"tool calls in this model's format start with the special token {tree['token']!r}, "
                           f"which only the xgrammar grammar backend can require, not {backend}", _PARAM)
    if kind == "sequence":
        return "".join(regex_of(child, schema_regex, backend) for child in tree["elements"])
    if kind == "or":
        return "(" + "|".join(regex_of(child, schema_regex, backend) for child in tree["elements"]) + ")"
    suffix = {"star": "*", "plus": "+", "optional": "?"}[kind]
    return f"({regex_of(tree['content'], schema_regex, backend)}){suffix}"


def _escaped(ch: str) -> str:
    if ch in _REGEX_SPECIAL:
        return "\\" + ch
    return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(ch, ch)
