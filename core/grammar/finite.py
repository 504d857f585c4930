"""JSON schemas that no finite JSON value satisfies, refused before any compile.

A schema whose required properties (or minimum items) lead back to itself through `$ref`,
such as `{"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}`,
compiles at once, but every output the grammar allows is an unfinished prefix: the model
writes `{"next":{"next":...` until max_tokens, minutes on a CPU, and the result never
parses. `check_finite` finds it as a least fixpoint over the schema's objects (which of
them have a finite instance, given which of the schemas they need do) and raises a
GrammarError naming a reference on the endless path.

Only what backends enforce counts: required properties, minItems over prefixItems/items,
allOf (all), anyOf/oneOf (any), enum/const (a literal is finite), and the type a schema
declares or that its keywords imply. Anything else is taken as satisfiable, so a schema is
refused only when it certainly recurses without end.
"""
from __future__ import annotations

from urllib.parse import unquote

from .spec import GrammarError, GrammarSpec
from .structural import nested_schemas

_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "minProperties")
_ARRAY_KEYWORDS = ("items", "prefixItems", "minItems")


def check_finite(spec: GrammarSpec) -> None:
    """Raise GrammarError if `spec` is a JSON schema with no finite instance (or holds one:
    a structural spec's schemas are each checked)."""
    if spec.kind == "structural":
        for nested in nested_schemas(spec):
            check_finite(nested)
        return
    if spec.kind != "json_schema":
        return
    root = spec.schema
    if not isinstance(root, dict):
        return  # `true` / `false`: the compiler's to judge
    schemas = _Schemas(root)
    finite = schemas.finite()
    if finite.get(id(root), True):
        return
    where = schemas.endless_reference(finite)
    raise GrammarError("the JSON schema has no finite instance: its required properties or minimum items "
                       f"refer back to themselves without end{where}, so no output could ever be complete",
                       "response_format")


class _Schemas:
    """Every schema object reachable from the root (through subschemas and local `$ref`s),
    each with the JSON pointer it was first reached at."""

    def __init__(self, root: dict):
        self.root = root
        self.nodes: dict[int, dict] = {}
        self.paths: dict[int, str] = {}
        stack = [(root, "#")]
        while stack:
            node, path = stack.pop()
            if not isinstance(node, dict) or id(node) in self.nodes:
                continue
            self.nodes[id(node)] = node
            self.paths[id(node)] = path
            stack.extend(_children(node, path))
            target = self.resolve(node)
            if target is not None:
                stack.append((target, node["$ref"]))

    def resolve(self, node: dict) -> dict | bool | None:
        """The schema a local `$ref` of `node` points at, or None (none, or not a JSON pointer)."""
        ref = node.get("$ref")
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return None  # a dangling reference: the compiler reports it
        return target if isinstance(target, (dict, bool)) else None

    def finite(self) -> dict[int, bool]:
        """Least fixpoint: a schema is finite once what it needs is; the rest recurse without end."""
        finite = dict.fromkeys(self.nodes, False)
        order = list(self.nodes.items())[::-1]  # subschemas before the schemas that hold them
        changed = True
        while changed:
            changed = False
            for key, node in order:
                if not finite[key] and self._has_finite_instance(node, finite):
                    finite[key] = changed = True
        return finite

    def endless_reference(self, finite: dict[int, bool]) -> str:
        """' (through $ref ... at ...)' for a reference on an endless path, shallowest first."""
        endless = [(self.paths[key], node["$ref"]) for key, node in self.nodes.items()
                   if not finite[key] and self.resolve(node) is not None]
        if not endless:
            return ""
        path, ref = min(endless, key=lambda item: (item[0].count("/"), item[0]))
        return f" (through $ref {ref!r} at {path})"

    def _has_finite_instance(self, node: dict, finite: dict[int, bool]) -> bool:
        def ok(schema) -> bool:
            if isinstance(schema, bool):
                return schema
            if isinstance(schema, dict):
                return finite.get(id(schema), True)
            return True  # not a schema: the meta-schema check refuses it

        if "enum" in node or "const" in node:
            return True
        target = self.resolve(node)
        if target is not None and not ok(target):
            return False
        if not all(ok(s) for s in _list(node.get("allOf"))):
            return False
        for key in ("anyOf", "oneOf"):
            branches = _list(node.get(key))
            if branches and not any(ok(s) for s in branches):
                return False
        return any(_type_finite(node, kind, ok) for kind in _types(node))


def _type_finite(node: dict, kind: str, ok) -> bool:
    if kind == "object":
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        return all(ok(properties.get(name, True)) for name in _list(node.get("required")) if isinstance(name, str))
    if kind == "array":
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        prefix = _list(node.get("prefixItems"))
        return all(ok(s) for s in prefix[:least]) and (least <= len(prefix) or ok(node.get("items", True)))
    return True


def _types(node: dict) -> list[str]:
    """The types `node` allows: declared, else implied by its keywords, else any."""
    declared = node.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list) and declared:
        return [t for t in declared if isinstance(t, str)]
    if any(k in node for k in _OBJECT_KEYWORDS):
        return ["object"]
    if any(k in node for k in _ARRAY_KEYWORDS):
        return ["array"]
    return ["any"]


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _children(node: dict, path: str):
    """(subschema, its path) for the keywords that decide finiteness."""
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            yield from ((sub, f"{path}/{key}/{name}") for name, sub in node[key].items())
    for key in ("items", "additionalProperties"):
        if key in node:
            yield node[key], f"{path}/{key}"
    for key in ("prefixItems", "allOf", "anyOf", "oneOf"):
        yield from ((sub, f"{path}/{key}/{i}") for i, sub in enumerate(_list(node.get(key))))
