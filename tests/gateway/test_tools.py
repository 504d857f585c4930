"""Tool calling on /v1/chat/completions: tool_choice none/auto/required/named (named
and required enforced by a grammar), tool calls in OpenAI's shape whole and
streamed, and the round trip through the OpenAI SDK and LangChain (tool call ->
tool result -> second turn). Pure parts (planning, parsing, stream deltas) are
tested without the server."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from switchyard.core.grammar import GrammarSpec
from switchyard.gateway.errors import ErrorKind, GatewayError
from switchyard.gateway.openai.schemas import ChatCompletionRequest
from switchyard.gateway.openai.tool_output import ChoiceDeltas, assistant_message
from switchyard.gateway.openai.tool_prompt import ToolRendering
from switchyard.gateway.openai.tools import parse_calls, tool_plan
from switchyard.gateway.settings import ServerSettings

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                      "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                         "parameters": {"type": "object",
                                                        "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                                        "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SETTINGS = ServerSettings(model_id=MODEL)


def _plan(settings=SETTINGS, **fields):
    return tool_plan(ChatCompletionRequest(model=MODEL, messages=ASK, **fields), settings)


# -- planning, parsing and deltas, without the server ---------------------------------------------------
def test_named_tool_choice_is_its_parameters_schema():
    plan = _plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert plan.mode == "named" and plan.named == "get_time"
    assert plan.grammar == GrammarSpec.json_schema(TIME["function"]["parameters"])
    assert _plan(tools=[WEATHER, TIME], tool_choice="get_weather").named == "get_weather"  # TGI: a bare name


def test_required_is_a_list_of_calls_unless_parallel_calls_are_off():
    schema = _plan(tools=[WEATHER, TIME], tool_choice="required").grammar.schema
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    jsonschema.validate([{"name": "get_time", "arguments": {"tz": "UTC"}}], schema)
    single = _plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).grammar.schema
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, single)


def test_auto_and_none_need_no_grammar():
    assert _plan(tools=[WEATHER]).mode == "auto" and _plan(tools=[WEATHER]).grammar is None
    assert _plan(tools=[WEATHER], tool_choice="none").grammar is None
    disabled = ServerSettings(model_id=MODEL, disable_grammar_support=True)
    assert _plan(disabled, tools=[WEATHER], tool_choice="auto").mode == "auto"
    with pytest.raises(GatewayError, match="disable-grammar-support"):
        _plan(disabled, tools=[WEATHER], tool_choice="required")


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
])
def test_bad_tools_are_named(fields, param):
    with pytest.raises(GatewayError) as caught:
        _plan(**fields)
    assert caught.value.param == param and caught.value.kind is ErrorKind.VALIDATION


def test_auto_output_is_a_call_only_when_it_is_one():
    plan = _plan(tools=[WEATHER, TIME])
    for text in ('{"name": "get_weather", "arguments": {"city": "Paris"}}',
                 ' <tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>',
                 '```json\n[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]\n```'):
        calls = parse_calls(plan, text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})], text
    for text in ("It is sunny.", '{"name": "unknown", "arguments": {}}', '{"city": "Paris"}', "{not json"):
        assert parse_calls(plan, text) is None, text
    two = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]'
    assert len(parse_calls(plan, two)) == 2
    assert len(parse_calls(_plan(tools=[WEATHER, TIME], parallel_tool_calls=False), two)) == 1


def test_whole_message_of_calls():
    plan = _plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    message, reason = assistant_message('{"name": "get_weather", "arguments": {"city": "Rome"}}', "stop", plan)
    call, = message["tool_calls"]
    assert message["content"] is None and reason == "tool_calls"
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert assistant_message("Hello", "stop", _plan(tools=[WEATHER])) == (
        {"role": "assistant", "content": "Hello", "refusal": None}, "stop")


def _stream(plan, pieces, finish="stop"):
    deltas = ChoiceDeltas(plan)
    out = []
    for piece in pieces:
        out += [d for d, _ in deltas.feed(piece, None)]
    last, reason = deltas.finish(finish)
    return out + [d for d, _ in last], reason


def test_stream_deltas_of_a_named_call_send_the_arguments_as_they_come():
    plan = _plan(tools=[WEATHER], tool_choice="get_weather")
    deltas, reason = _stream(plan, ['{"city"', ': "Paris"}'])
    assert reason == "stop"  # a named tool_choice ends with "stop", as OpenAI's API does
    head = deltas[0]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["function"]["name"] == "get_weather"
    rest = [d["tool_calls"][0] for d in deltas[1:]]
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert "".join(d["function"]["arguments"] for d in rest) == '{"city": "Paris"}'


def test_stream_deltas_of_required_calls_come_as_they_are_generated():
    plan = _plan(tools=[WEATHER, TIME], tool_choice="required")
    text = '[{"name": "get_weather", "arguments": {"city": "O}s\\"lo"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]'
    deltas = ChoiceDeltas(plan)
    sent = []
    for i in range(0, len(text), 5):
        sent.append([d["tool_calls"][0] for d, _ in deltas.feed(text[i:i + 5], None)])
    last, reason = deltas.finish("stop")
    assert last == [] and reason == "tool_calls"
    first_call_at = next(i for i, d in enumerate(sent) if d)
    assert first_call_at < len(sent) // 3  # the first call starts before the output is complete
    pieces = [d for ds in sent for d in ds]
    assert [p["function"]["name"] for p in pieces if "id" in p] == ["get_weather", "get_time"]
    arguments = ["".join(p["function"]["arguments"] for p in pieces if p["index"] == i) for i in (0, 1)]
    assert [json.loads(a) for a in arguments] == [{"city": 'O}s"lo'}, {"tz": "UTC"}]
    message, _ = assistant_message(text, "stop", plan)
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == arguments  # the same whole
    assert _stream(plan, ["No", " call"]) == ([{"content": "No call"}], "stop")  # no grammar applied


def test_a_required_call_cut_off_before_its_name_is_no_content():
    """Cut by the length limit inside `{"name": "get_w`: neither a call nor an answer,
    so the fragment is not returned as content, whole or streamed."""
    plan = _plan(tools=[WEATHER, TIME], tool_choice="required")
    fragment = '[{"name": "get_w'
    message, reason = assistant_message(fragment, "length", plan)
    assert message["content"] is None and "tool_calls" not in message and reason == "length"
    assert _stream(plan, ['[{"na', 'me": "get_w'], finish="length") == ([], "length")
    cut_in_arguments, reason = assistant_message('[{"name": "get_time", "arguments": {"tz": "U', "length", plan)
    assert cut_in_arguments["tool_calls"][0]["function"]["name"] == "get_time" and reason == "length"


def test_stream_deltas_of_auto_hold_back_only_what_may_be_a_call():
    plan = _plan(tools=[WEATHER, TIME])
    text, reason = _stream(plan, [" It", " is", " sunny."])
    assert [d["content"] for d in text] == [" It", " is", " sunny."] and reason == "stop"
    calls, reason = _stream(plan, ['[{"name": "get_time", ', '"arguments": {"tz": "UTC"}},',
                                   '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'])
    assert reason == "tool_calls" and [d["tool_calls"][0]["index"] for d in calls] == [0, 0, 1, 1]
    assert [d["tool_calls"][0]["function"].get("name") for d in calls] == ["get_time", None, "get_weather", None]
    not_a_call, reason = _stream(plan, ["{", "oops"], "length")
    assert not_a_call == [{"content": "{oops"}] and reason == "length"


def test_template_without_tools_gets_them_in_the_system_prompt_and_calls_as_text():
    rendering = ToolRendering.for_template("{{ message['content'] }}")
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    messages = rendering.messages(history, _plan(tools=[WEATHER]), None)
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert "tool_calls" not in messages[2] and messages[3]["content"] == "Result of get_weather: sunny"
    assert ToolRendering.for_template("{% for t in tools %}{{ m.tool_calls }}{% endfor %}").messages(
        history, _plan(tools=[WEATHER]), None) == history


# -- over HTTP ------------------------------------------------------------------------------------------
def _sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0)


def _args(call, tool=WEATHER) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_named_and_required_tool_choice_are_enforced(server):
    sdk = _sdk(server)
    named = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                        max_tokens=30, tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # named: "stop", as OpenAI
    call, = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    _args(call)
    required = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                           max_tokens=60, tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        _args(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])
    assert len({call.id for call in calls}) == len(calls)


def test_tools_whose_grammar_cannot_compile_are_a_400_naming_them(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        _sdk(server).chat.completions.create(model=MODEL, messages=ASK, tools=[tool], tool_choice="required",
                                             max_tokens=4)
    assert caught.value.body["param"] == "tools" and "ookbehind" in caught.value.body["message"]


def test_auto_answers_in_text_when_it_does_not_call_and_none_never_calls(server):
    sdk = _sdk(server)
    for choice in ("auto", "none"):
        answer = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                             tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=8)
        message = answer.choices[0].message
        assert message.content and not message.tool_calls, choice


def test_auto_returns_an_answer_that_is_a_call_as_tool_calls(server):
    """Here a response_format makes the answer a call, so `auto` must read it as one, whole and streamed."""
    call_schema = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_PARAMETERS},
                   "required": ["name", "arguments"], "additionalProperties": False}
    ask = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", temperature=0, max_tokens=30,
               response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": call_schema}})
    sdk = _sdk(server)
    whole = sdk.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert _args(whole.message.tool_calls[0]) == json.loads(whole.message.tool_calls[0].function.arguments)
    chunks = [c.choices[0] for c in sdk.chat.completions.create(**ask, stream=True) if c.choices]
    assert not any(c.delta.content for c in chunks) and chunks[-1].finish_reason == "tool_calls"
    pieces = [c.delta.tool_calls[0] for c in chunks if c.delta.tool_calls]
    assert pieces[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments for p in pieces)) == json.loads(
        whole.message.tool_calls[0].function.arguments)


@pytest.mark.slow
def test_streamed_tool_calls_through_the_sdk(server):
    sdk = _sdk(server)
    ask = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=30,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [c.choices[0].delta for c in sdk.chat.completions.create(**ask, stream=True) if c.choices]
    pieces = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:]) and len(pieces) > 2
    with sdk.chat.completions.stream(**ask) as stream:
        final = stream.get_final_completion()
    call, = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "stop"  # named
    assert call.function.arguments == "".join(p.function.arguments for p in pieces)
    _args(call)
    with sdk.chat.completions.stream(**{**ask, "tool_choice": "required", "tools": [WEATHER, TIME],
                                        "max_tokens": 60}) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.tool_calls
    for call in final.choices[0].message.tool_calls:
        _args(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_the_prompt_carries_tools_calls_and_results(http):
    """SmolLM2's template ignores tools: they are written into the system prompt (TGI's /chat_tokenize
    shows the prompt /v1/chat/completions renders), earlier calls as JSON, results by function name."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 C"}]
    text = http.post("/chat_tokenize", json={"messages": history, "tools": [WEATHER], "tool_choice": "required",
                                             "tool_prompt": "Tools:"}).json()["templated_text"]
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nTools:\n") and '"name": "get_weather"' in system
    assert "one or more function calls" in system
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris"}}<|im_end|>' in text
    assert "<|im_start|>tool\nResult of get_weather: Sunny, 22 C<|im_end|>" in text


def test_tool_results_go_back_to_the_model(server):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 C"}]
    answer = _sdk(server).chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0,
                                                  max_tokens=12)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


def test_legacy_functions_answer_with_function_call(http):
    r = http.post("/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 30, "temperature": 0, "functions": [WEATHER["function"]],
        "function_call": {"name": "get_weather"}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]  # named: "stop"
    jsonschema.validate(json.loads(choice["message"]["function_call"]["arguments"]), WEATHER_PARAMETERS)


@pytest.mark.slow
def test_langchain_bind_tools_round_trip_and_stream(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.openai_url, api_key="none", model=MODEL, temperature=0, max_tokens=30)
    with_tools = llm.bind_tools([WEATHER], tool_choice="get_weather")
    question = HumanMessage(ASK[0]["content"])
    reply = with_tools.invoke([question])
    call, = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER_PARAMETERS)
    follow_up = llm.invoke([question, reply, ToolMessage("Sunny, 22 C", tool_call_id=call["id"])])
    assert isinstance(follow_up.content, str) and follow_up.content
    streamed = None
    for chunk in with_tools.stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["get_weather"]
    jsonschema.validate(streamed.tool_calls[0]["args"], WEATHER_PARAMETERS)


@pytest.mark.slow
def test_langchain_with_structured_output_function_calling(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=20)
        sunny: bool

    llm = ChatOpenAI(base_url=server.openai_url, api_key="none", model=MODEL, temperature=0, max_tokens=30)
    weather = llm.with_structured_output(Weather, method="function_calling").invoke(ASK[0]["content"])
    assert isinstance(weather, Weather)


@pytest.mark.slow
def test_inference_client_chat_completion_with_tools(server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.base_url)
    answer = client.chat_completion(ASK, tools=[WEATHER], tool_choice={"function": {"name": "get_weather"}},
                                    tool_prompt="Use the tools.", max_tokens=30, temperature=0)
    call = answer.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and answer.choices[0].finish_reason == "stop"  # named
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


@pytest.mark.slow
def test_sdk_parse_with_a_strict_pydantic_tool(server):
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=20)

    completion = _sdk(server).chat.completions.parse(
        model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=30)
    call, = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather) and call.function.name == "GetWeather"


def test_required_tools_with_pydantic_nested_models_are_enforced(server):
    """pydantic writes nested models as `$defs` + `$ref`: inside the calls schema the refs
    are rebased, so the grammar compiles (it was a 400) and enforces the nested model."""
    from pydantic import BaseModel

    class Address(BaseModel):
        city: str
        zip_code: int

    class SaveContact(BaseModel):
        name: str
        home: Address

    tool = openai.pydantic_function_tool(SaveContact)
    assert "$defs" in tool["function"]["parameters"]
    for parallel in (True, False):
        completion = _sdk(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Save Ann, who lives in Paris 75001."}],
            tools=[tool, WEATHER], tool_choice="required", parallel_tool_calls=parallel, temperature=0,
            max_tokens=80)
        calls = completion.choices[0].message.tool_calls
        assert completion.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            _args(call, tool if call.function.name == "SaveContact" else WEATHER)
    schema = _plan(tools=[tool, WEATHER], tool_choice="required").grammar.schema
    jsonschema.validate([{"name": "SaveContact", "arguments": {"name": "A", "home": {"city": "P", "zip_code": 1}}}],
                        schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "SaveContact", "arguments": {"name": "A", "home": {"city": "P"}}}], schema)
