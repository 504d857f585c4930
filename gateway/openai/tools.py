"""`tools` + `tool_choice` (and the legacy `functions` + `function_call`) -> what to
ask of the engine and how to read its output.

- `none`: the tools are rendered into the prompt; the answer is text.
- `auto`: the model answers freely, and an answer that *is* a tool call (a JSON
  object `{"name", "arguments"}`, a list of them, or either inside `<tool_call>`
  tags or a ```json fence) is returned as tool calls; anything else is text (vLLM's
  way). No grammar: a plain answer is never bent into JSON, there is no second
  generation when no tool is picked (TGI's `no_tool` way), and it works with
  --disable-grammar-support.
- `required`: a grammar forces `{"name": <one of the tools>, "arguments": <its
  parameters>}`: a list of one or more of them unless parallel_tool_calls is false.
- named (`{"type": "function", "function": {"name"}}`, or TGI's bare name): a
  grammar forces that function's arguments object alone (vLLM's way): the model
  fills only the part it has to, and its text streams as the call's arguments.

That is the JSON format, for a model whose chat template shows no tool format. A model
served with a tool-call parser (gateway/tool_parsers: `--tool-call-parser`, or the one its
template shows) is read in its own format instead: `auto` parses its calls wherever its
answer holds them, and `required` / named force one call (or more) in that format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from switchyard.core.grammar import GrammarSpec

from ..errors import invalid
from ..structured import check_enabled, checked_schema
from ..settings import ServerSettings
from ..tool_parsers import ToolFormat, ToolParser
from .schemas import ChatCompletionRequest

_NO_PARAMETERS = {"type": "object", "properties": {}}
_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of the arguments object


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None  # the function a named tool_choice forces
    parallel: bool  # more than one call allowed
    legacy: bool  # asked with `functions`: answered with `function_call`
    param: str  # "tool_choice" or "function_call": what asks for a grammar
    tools_param: str  # "tools" or "functions": what a grammar that cannot compile comes from
    parser: ToolParser | None = None  # the model's own format (gateway/tool_parsers); None: JSON
    hidden: frozenset[str] = frozenset()  # special-token texts the format keeps but the client skips

    @property
    def calls(self) -> bool:
        """Whether the output may be read as tool calls."""
        return self.mode != "none"

    @property
    def keeps_special_tokens(self) -> bool:
        """The format's markers are special tokens: the output keeps them (skip_special_tokens off)."""
        return self.parser is not None and self.calls and self.parser.keeps_special_tokens

    @property
    def grammar(self) -> GrammarSpec | None:
        if self.parser is not None and self.mode in ("named", "required"):
            tools = [self._tool(self.named)] if self.mode == "named" else list(self.tools)
            return GrammarSpec.structural(self.parser.grammar(tools, self.parallel and self.mode == "required"))
        if self.mode == "named":
            return GrammarSpec.json_schema(self._tool(self.named).parameters)
        if self.mode != "required":
            return None
        defs: dict = {}
        calls = [_call_schema(tool, defs) for tool in self.tools]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": one, "minItems": 1} if self.parallel else one
        return GrammarSpec.json_schema({**schema, "$defs": defs} if defs else schema)

    def _tool(self, name: str) -> Tool:
        return next(tool for tool in self.tools if tool.name == name)

    def definitions(self) -> list[dict]:
        """The tools in OpenAI's shape, for a chat template that renders `tools`."""
        return [{"type": "function", "function": {"name": t.name, "parameters": t.parameters,
                                                  **({"description": t.description} if t.description else {})}}
                for t in self.tools]


def _call_schema(tool: Tool, defs: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": _arguments(tool, defs)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _arguments(tool: Tool, defs: dict) -> dict:
    """A tool's parameters inside the calls schema. Parameters with local references
    (pydantic's nested models: `$defs` + `"$ref": "#/$defs/Inner"`) move to the root's
    `$defs` under the tool's name, their references rebased there, since "#" is now the
    calls schema's root."""
    if not _has_local_ref(tool.parameters):
        return tool.parameters
    base = "#/$defs/" + tool.name.replace("~", "~0").replace("/", "~1")
    defs[tool.name] = _rebased(tool.parameters, base)
    return {"$ref": base}


def _has_local_ref(node) -> bool:
    if isinstance(node, dict):
        return any(k == "$ref" and isinstance(v, str) and v.startswith("#") or _has_local_ref(v)
                   for k, v in node.items())
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _rebased(node, base: str):
    """A copy of `node` with each local `$ref` "#<pointer>" made "<base><pointer>"."""
    if isinstance(node, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    return node


def tool_plan(req: ChatCompletionRequest, settings: ServerSettings,
              tool_format: ToolFormat | None = None) -> ToolPlan | None:
    """The request's tools and choice; `tool_format`: the served model's own call format, if any."""
    if req.tools is not None and req.functions is not None:
        raise invalid("send tools or the deprecated functions, not both", "functions")
    legacy = req.functions is not None or (req.tools is None and req.function_call is not None)
    tools_param, choice_param = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    raw_tools = req.functions if legacy else req.tools
    choice = req.function_call if legacy else req.tool_choice
    if raw_tools is None:
        if choice not in (None, "none"):
            raise invalid(f"{choice_param} needs {tools_param}", choice_param)
        return None
    if not raw_tools:
        raise invalid(f"{tools_param} must not be empty", tools_param)
    tools = tuple(_tool(i, t, tools_param, legacy) for i, t in enumerate(raw_tools))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid(f"{tools_param} has two functions of one name", tools_param)
    mode, named = _choice(choice, names, choice_param)
    if mode in ("required", "named"):
        check_enabled(settings, choice_param)
    parallel = req.parallel_tool_calls is not False and not legacy
    parser = tool_format.for_tools(tools) if tool_format is not None else None
    hidden = frozenset()
    if parser is not None and parser.keeps_special_tokens and req.skip_special_tokens:
        hidden = parser.context.special_texts - set(parser.special_markers)
    return ToolPlan(tools, mode, named, parallel, legacy, choice_param, tools_param, parser, hidden)


def _tool(index: int, raw: dict, param: str, legacy: bool) -> Tool:
    where = f"{param}.{index}"
    if not isinstance(raw, dict):
        raise invalid("each tool must be an object", where)
    if not legacy:
        if raw.get("type", "function") != "function":
            raise invalid(f"only tools of type 'function' are supported, not {raw.get('type')!r}", f"{where}.type")
        raw = raw.get("function")
        where += ".function"
        if not isinstance(raw, dict):
            raise invalid("a tool needs `function`: {name, description?, parameters?}", where)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("a function needs a non-empty `name`", f"{where}.name")
    parameters = raw.get("parameters")
    parameters = _NO_PARAMETERS if parameters is None else checked_schema(parameters, f"{where}.parameters")
    if parameters is True or parameters == {}:
        parameters = _NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise invalid("a function's parameters must be an object schema", f"{where}.parameters")
    return Tool(name, raw.get("description"), parameters)


def _choice(choice, names: list[str], param: str) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice in _MODES:
            return choice, None
        if choice in names:  # TGI accepts a bare function name
            return "named", choice
        raise invalid(f"{param} must be 'none', 'auto', 'required' or a function of the tools; got {choice!r}",
                      param)
    function = choice.get("function") if choice.get("type", "function") == "function" else None
    name = (function or {}).get("name") if isinstance(function, dict) else choice.get("name")
    if not isinstance(name, str):
        raise invalid(f"{param} must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}", param)
    if name not in names:
        raise invalid(f"{param} names the function {name!r}, which is not among the tools "
                      f"({', '.join(names)})", param)
    return "named", name


# -- reading the output ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def parse_calls(plan: ToolPlan, text: str) -> list[ParsedCall] | None:
    """The tool calls `text` is, or None when it is not (then it is a text answer)."""
    if plan.mode == "named":
        return [ParsedCall(plan.named, text.strip())]
    items = _json_items(text)
    if items is None:
        return None
    known = {t.name for t in plan.tools}
    calls = []
    for item in items:
        call = _call(item, known)
        if call is None:
            return None
        calls.append(call)
    if not calls:
        return None
    return calls if plan.parallel else calls[:1]


def _json_items(text: str) -> list | None:
    body = text.strip()
    if body.startswith("```"):
        body = body.strip("`").strip()
        body = body[4:] if body.startswith("json") else body
    if "<tool_call>" in body:
        pieces = [p.split("</tool_call>")[0] for p in body.split("<tool_call>")[1:]]
        if body.split("<tool_call>")[0].strip():
            return None
        values = [_loads(p) for p in pieces]
        return None if any(v is None for v in values) else values
    value = _loads(body)
    if isinstance(value, list):
        return value
    return None if value is None else [value]


def _loads(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _call(item, known: set[str]) -> ParsedCall | None:
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict) and "name" not in item:  # {"function": {...}}
        item = item["function"]
    name = item.get("name")
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if name not in known or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))
