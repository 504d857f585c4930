"""The structured output an OpenAI-dialect request asks for -> one `GrammarSpec`.

Sources, at most one per request: `response_format` (OpenAI's `text`, `json_object`,
`json_schema`; TGI's `json`, `json_object` with a schema `value`, `json_schema` with
`{name, schema}`, `regex`, since TGI's chat route is this one), and vLLM's extras
`guided_json`, `guided_regex`, `guided_choice` and `structured_outputs`.
"""
from __future__ import annotations

from dataclasses import dataclass

from switchyard.core.grammar import GrammarSpec

from ..settings import ServerSettings
from ..errors import invalid
from ..structured import check_enabled, choice_spec, regex_spec, schema_spec, tgi_grammar_spec
from .schemas import ResponseFormat, SamplingFields

_GUIDED = ("guided_json", "guided_regex", "guided_choice")


@dataclass(frozen=True)
class OutputGrammar:
    spec: GrammarSpec
    param: str  # the request field that asked for it: errors name it


def output_grammar(req: SamplingFields, settings: ServerSettings,
                   response_format: ResponseFormat | None = None) -> OutputGrammar | None:
    asked: list[OutputGrammar] = []
    if response_format is not None and response_format.type != "text":
        check_enabled(settings, "response_format")
        asked.append(OutputGrammar(response_format_spec(response_format), "response_format"))
    for name in _GUIDED:
        value = getattr(req, name)
        if value is not None:
            check_enabled(settings, name)
            asked.append(OutputGrammar(_guided_spec(name, value), name))
    if req.guided_grammar is not None:
        raise invalid("guided_grammar (EBNF grammars) is not supported; use guided_json, guided_regex or "
                      "guided_choice", "guided_grammar")
    if req.structured_outputs is not None:
        check_enabled(settings, "structured_outputs")
        asked.append(OutputGrammar(_structured_outputs_spec(req.structured_outputs), "structured_outputs"))
    if len(asked) > 1:
        raise invalid(f"only one of response_format, {', '.join(_GUIDED)} and structured_outputs may constrain "
                      f"the output; got {asked[0].param} and {asked[1].param}", asked[1].param)
    return asked[0] if asked else None


def response_format_spec(fmt: ResponseFormat) -> GrammarSpec:
    param = "response_format"
    if fmt.type == "json_object" and fmt.value is None:
        return GrammarSpec.json_object()  # OpenAI: any JSON object
    if fmt.type == "json_schema" and fmt.value is None:
        if fmt.json_schema is None:
            raise invalid("response_format of type 'json_schema' needs `json_schema`: {name, schema, strict}", param)
        if "schema" not in fmt.json_schema:  # OpenAI: a schema-less json_schema allows any JSON object
            return GrammarSpec.json_object()
        return schema_spec(fmt.json_schema["schema"], param)
    if fmt.type in ("json", "json_object", "json_schema", "regex"):  # TGI's dialect
        return tgi_grammar_spec(fmt.type, fmt.value, param)
    raise invalid(f"unknown response_format type {fmt.type!r}: expected 'text', 'json_object' or 'json_schema' "
                  "(or TGI's 'json' and 'regex' with a `value`)", param)


def _guided_spec(name: str, value) -> GrammarSpec:
    if name == "guided_json":
        return schema_spec(value, name)
    if name == "guided_regex":
        return regex_spec(value, name)
    return choice_spec(value, name)


def _structured_outputs_spec(options) -> GrammarSpec:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, json_object."""
    param = "structured_outputs"
    if not isinstance(options, dict):
        raise invalid("structured_outputs must be an object such as {\"json\": <schema>}", param)
    kinds = {k: v for k, v in options.items() if v not in (None, False)
             and k in ("json", "regex", "choice", "json_object", "grammar", "structural_tag")}
    if len(kinds) != 1:
        raise invalid("structured_outputs must set exactly one of json, regex, choice and json_object", param)
    (kind, value), = kinds.items()
    if kind == "json":
        return schema_spec(value, f"{param}.json")
    if kind == "regex":
        return regex_spec(value, f"{param}.regex")
    if kind == "choice":
        return choice_spec(value, f"{param}.choice")
    if kind == "json_object":
        return GrammarSpec.json_object()
    raise invalid(f"structured_outputs.{kind} is not supported; use json, regex, choice or json_object",
                  f"{param}.{kind}")
