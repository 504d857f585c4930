"""Structured output over HTTP, both dialects, through the clients people use:
OpenAI's `response_format` (json_schema, json_object) and vLLM's guided_* /
structured_outputs; TGI's `parameters.grammar` and its chat `response_format`;
the OpenAI SDK's parse(), LangChain's with_structured_output, LlamaIndex's
structured_predict and huggingface_hub's InferenceClient. The default model is
tiny, so validity comes from the grammar: every output must parse and validate.
Errors (invalid schema, unsupported feature, bad regex, grammar support off) are
a 400 on OpenAI routes and a 422 on TGI's, naming the field, before the engine
sees the request."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from switchyard.core.grammar import GrammarError, GrammarSpec
from switchyard.gateway.errors import ErrorKind, GatewayError
from switchyard.gateway.metrics import Metrics
from switchyard.gateway.openai.formats import response_format_spec
from switchyard.gateway.openai.schemas import ResponseFormat
from switchyard.gateway.service import GenerationService
from switchyard.gateway.settings import ServerSettings
from switchyard.gateway.structured import choice_spec, tgi_grammar_spec

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "student": {"type": "boolean"}}, "required": ["name", "age", "student"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe Alice, a 30 year old teacher, as JSON."}]
LIMIT = 48  # tokens: the bounded schemas above need ~25


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    student: bool


def _sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0)


def _valid(text: str, schema: dict = PERSON_SCHEMA):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# -- spec building, without the server --------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "spec"), [
    ({"type": "json_object"}, GrammarSpec.json_object()),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA, "strict": True}},
     GrammarSpec.json_schema(PERSON_SCHEMA)),
    ({"type": "json_object", "value": PERSON_SCHEMA}, GrammarSpec.json_schema(PERSON_SCHEMA)),  # InferenceClient
    ({"type": "json", "value": json.dumps(PERSON_SCHEMA)}, GrammarSpec.json_schema(PERSON_SCHEMA)),  # TGI
    ({"type": "json_schema", "value": {"name": "p", "schema": PERSON_SCHEMA}}, GrammarSpec.json_schema(PERSON_SCHEMA)),
    ({"type": "regex", "value": "[0-9]+"}, GrammarSpec.regex("[0-9]+")),
])
def test_response_format_in_both_dialects(fmt, spec):
    assert response_format_spec(ResponseFormat(**fmt)) == spec


def test_choices_are_escaped_alternatives():
    pattern = choice_spec(["a.b", "c (d)", "e"], "guided_choice").value
    assert re.fullmatch(pattern, "c (d)") and re.fullmatch(pattern, "a.b") and not re.fullmatch(pattern, "axb")


@pytest.mark.parametrize(("kind", "value", "message"), [
    ("json", {"type": "nope"}, "invalid JSON schema"),
    ("json", "{not json", "not valid JSON"),
    ("json", None, "needs a JSON schema"),
    ("json_schema", {"name": "x"}, "{\"name\", \"schema\"}"),
    ("regex", "(unclosed", "invalid regex"),
    ("ebnf", "root ::= x", "unknown grammar type"),
])
def test_bad_grammars_name_the_problem(kind, value, message):
    with pytest.raises(GatewayError, match=re.escape(message)) as caught:
        tgi_grammar_spec(kind, value, "grammar")
    assert caught.value.param == "grammar"


class _StreamFailingToCompile:
    """A request stream whose grammar fails in the engine after submission."""

    finished = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise GrammarError("the grammar took too long to compile", "grammar")

    def abort(self) -> None:
        pass


def test_a_grammar_error_from_the_engine_is_a_validation_error():
    service = GenerationService(None, ServerSettings(model_id=MODEL), Metrics())

    async def merged():
        async for _ in service.merged([_StreamFailingToCompile()]):
            pass

    for work in (merged(), service.collect(_StreamFailingToCompile())):
        with pytest.raises(GatewayError, match="too long") as caught:
            asyncio.run(work)
        assert caught.value.kind is ErrorKind.VALIDATION and caught.value.param == "grammar"


# -- OpenAI dialect over HTTP ------------------------------------------------------------------------
@pytest.mark.slow
def test_sdk_parse_round_trip(server):
    completion = _sdk(server).chat.completions.parse(model=MODEL, messages=ASK_PERSON, response_format=Person,
                                                     max_tokens=LIMIT, temperature=0)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person) and completion.choices[0].finish_reason == "stop"
    _valid(message.content, Person.model_json_schema())


@pytest.mark.slow
def test_json_schema_with_n_and_seed_is_valid_and_reproducible(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    ask = dict(model=MODEL, messages=ASK_PERSON, response_format=fmt, max_tokens=LIMIT, n=2, seed=11,
               temperature=0.7)
    first = _sdk(server).chat.completions.create(**ask)
    again = _sdk(server).chat.completions.create(**ask)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    for choice in first.choices:
        _valid(choice.message.content)


def test_json_object_and_stream(server):
    sdk = _sdk(server)
    answer = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Answer with the JSON object {"ok": true}.'}],
        response_format={"type": "json_object"}, max_tokens=LIMIT, temperature=0)
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK_PERSON, response_format=fmt,
                                              max_tokens=LIMIT, temperature=0, stream=True))
    _valid("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_vllm_guided_extras_on_chat_and_completions(server):
    sdk = _sdk(server)
    choice = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}],
                                         max_tokens=8, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    digits = sdk.completions.create(model=MODEL, prompt="Three digits:", max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text)
    person = sdk.completions.create(model=MODEL, prompt="Alice as JSON:", max_tokens=LIMIT, temperature=0,
                                    extra_body={"structured_outputs": {"json": PERSON_SCHEMA}})
    _valid(person.choices[0].text)


@pytest.mark.slow
def test_langchain_with_structured_output_json_schema(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.openai_url, api_key="none", model=MODEL, temperature=0, max_tokens=LIMIT)
    person = llm.with_structured_output(Person, method="json_schema").invoke(ASK_PERSON[0]["content"])
    assert isinstance(person, Person)


@pytest.mark.slow
def test_llamaindex_structured_predict(server):
    import asyncio

    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=server.openai_url, api_key="none", is_chat_model=True,
                     is_function_calling_model=True, temperature=0, max_tokens=LIMIT)
    prompt = PromptTemplate("Describe {who} as a person.")
    assert isinstance(llm.structured_predict(Person, prompt, who="Alice, a 30 year old teacher"), Person)
    assert isinstance(asyncio.run(llm.astructured_predict(Person, prompt, who="Bob, a student")), Person)


# -- TGI dialect over HTTP ---------------------------------------------------------------------------
@pytest.mark.slow
def test_inference_client_text_generation_with_grammar(server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.base_url)
    text = client.text_generation("Alice as JSON:", max_new_tokens=LIMIT,
                                  grammar={"type": "json", "value": PERSON_SCHEMA})
    _valid(text)
    digits = client.text_generation("Three digits:", max_new_tokens=8, grammar={"type": "regex", "value": "[0-9]{3}"},
                                    details=True)
    assert re.fullmatch("[0-9]{3}", digits.generated_text) and digits.details.finish_reason == "eos_token"
    streamed = "".join(client.text_generation("Alice as JSON:", max_new_tokens=LIMIT, stream=True,
                                              grammar={"type": "json_schema", "value": {"name": "p",
                                                                                        "schema": PERSON_SCHEMA}}))
    _valid(streamed)


@pytest.mark.slow
def test_inference_client_chat_completion_with_response_format(server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.base_url)
    for fmt in ({"type": "json_object", "value": PERSON_SCHEMA},  # TGI's form
                {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}):  # rewritten
        answer = client.chat_completion(ASK_PERSON, max_tokens=LIMIT, temperature=0, response_format=fmt)
        _valid(answer.choices[0].message.content)


# -- errors ------------------------------------------------------------------------------------------
def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD_SCHEMAS = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "regex", "value": "(a"}, "invalid regex"),
    ({"type": "regex", "value": "(?<=a)b"}, "ookbehind"),  # valid in Python; the grammar compiler refuses it
    # valid JSON Schema, but xgrammar would ignore `not`: refused rather than not enforced
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "not": {"const": 3}}}},
     "keyword 'not' (at #) is not supported"),
    # deeper than the meta-schema check can recurse (80 JSON levels: under the body guard's
    # MAX_JSON_DEPTH, over the schema check's 64): a 4xx, not a RecursionError
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(40)}}, "nests more than 64 levels"),
    # a reference outside the schema is never fetched, nor left unconstrained
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}},
     "'https://example.com/s.json' (at #) is not local"),
    # past --grammar-max-spec-bytes: refused before any compile
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [f"v{i:07d}" for i in range(30000)]}}},
     "more than this server's limit of 262144"),
]


@pytest.mark.parametrize(("fmt", "message"), BAD_SCHEMAS)
def test_openai_route_rejects_bad_grammars_with_400(server, fmt, message):
    before = server.app.state.metrics.request_input_length.count()
    with pytest.raises(openai.BadRequestError) as caught:
        _sdk(server).chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=4, response_format=fmt)
    assert caught.value.body["param"] == "response_format" and message in caught.value.body["message"]
    assert server.app.state.metrics.request_input_length.count() == before  # the engine never saw it


@pytest.mark.parametrize(("fmt", "message"), BAD_SCHEMAS)
def test_tgi_route_rejects_bad_grammars_with_422(http, fmt, message):
    grammar = {"type": "json_schema", "value": fmt["json_schema"]} if "json_schema" in fmt else fmt
    for path, extra in (("/generate", {}), ("/generate_stream", {}), ("/", {"stream": True})):
        r = http.post(path, json={"inputs": "x", "parameters": {"max_new_tokens": 4, "grammar": grammar}, **extra})
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["error_type"] == "validation" and message in body["error"]


def test_disabled_grammar_support_refuses_what_needs_a_grammar(start_server):
    import httpx

    server = start_server(disable_grammar_support=True)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.post("/generate", json={"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "a"}}})
        assert r.status_code == 422 and "grammar is not supported" in r.json()["error"]
        for fields, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                              ({"guided_regex": "a"}, "guided_regex"),
                              ({"tools": [tool], "tool_choice": "required"}, "tool_choice")):
            r = http.post("/v1/chat/completions", json={"messages": ASK_PERSON, "max_tokens": 2, **fields})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = http.post("/v1/chat/completions", json={"messages": ASK_PERSON, "max_tokens": 2, "tools": [tool],
                                                    "response_format": {"type": "text"}})
        assert r.status_code == 200  # tool_choice auto needs no grammar
