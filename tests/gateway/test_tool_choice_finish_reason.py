"""The finish_reason of a chat choice that calls tools, and what the client libraries do with it.

OpenAI's API ends a choice whose call was forced by a named `tool_choice`
(`{"type": "function", "function": {"name": ...}}`, or the deprecated `function_call:
{"name": ...}`) with finish_reason "stop"; `auto` and `required` end with "tool_calls"
("function_call" for `functions`); a call cut off by `max_tokens` ends with "length".
Switchyard decides this in one place (`gateway/openai/tool_output.py`,
`_calls_finish_reason`), whole and streamed.

What the clients do with the word (read in their installed source):

- The OpenAI SDK (openai 2.x) never looks for "tool_calls". `chat.completions.parse`
  (`lib/_parsing/_completions.py`) raises only on "length" and "content_filter" and parses
  `message.tool_calls` whatever the reason; the `chat.completions.stream` helper
  (`lib/streaming/chat/_completions.py`) fires its `content.done` and
  `tool_calls.function.arguments.done` events on any non-null finish_reason, and raises on
  "length" / "content_filter" only when tools or a response format are parseable.
- LangChain (`langchain_openai` ChatOpenAI, `_convert_dict_to_message`) builds
  `AIMessage.tool_calls` from `message.tool_calls` alone; the finish_reason is only copied into
  `response_metadata`, and checked only for "content_filter" (`_raise_on_refusal`). Tool loops
  (`with_structured_output(method="function_calling")`, agents, LangGraph's `tools_condition`)
  branch on `AIMessage.tool_calls`, not on the finish_reason.

So "stop" on a named choice breaks neither loop; these tests drive both against the app."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from switchyard.gateway.openai.schemas import ChatCompletionRequest
from switchyard.gateway.openai.tool_output import ChoiceDeltas, assistant_message
from switchyard.gateway.openai.tools import tool_plan
from switchyard.gateway.settings import ServerSettings

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": PARAMETERS}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '{"name": "get_weather", "arguments": {"city": "Rome"}}'


def _plan(**fields):
    return tool_plan(ChatCompletionRequest(model=MODEL, messages=ASK, **fields), ServerSettings(model_id=MODEL))


@pytest.mark.parametrize(("fields", "text", "expected"), [
    ({"tools": [WEATHER], "tool_choice": NAMED}, '{"city": "Rome"}', "stop"),
    ({"tools": [WEATHER], "tool_choice": "get_weather"}, '{"city": "Rome"}', "stop"),  # TGI's bare name
    ({"tools": [WEATHER], "tool_choice": "required"}, f"[{CALL}]", "tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, CALL, "tool_calls"),
    ({"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}, '{"city": "Rome"}', "stop"),
    ({"functions": [WEATHER["function"]], "function_call": "auto"}, CALL, "function_call"),
])
def test_the_finish_reason_of_calls_whole_and_streamed(fields, text, expected):
    plan = _plan(**fields)
    message, reason = assistant_message(text, "stop", plan)
    assert reason == expected and message["content"] is None
    assert message.get("tool_calls") or message.get("function_call")
    deltas = ChoiceDeltas(plan)
    sent = [d for piece in (text[:7], text[7:]) for d, _ in deltas.feed(piece, None)]
    last, streamed = deltas.finish("stop")
    assert streamed == expected and any("tool_calls" in d or "function_call" in d
                                          for d in sent + [d for d, _ in last])
    assert assistant_message(text, "length", plan)[1] == "length"  # cut short, whatever the choice
    assert ChoiceDeltas(plan).finish("length")[1] == "length"


def test_text_without_calls_keeps_its_own_finish_reason():
    assert assistant_message("Hello", "stop", _plan(tools=[WEATHER]))[1] == "stop"
    assert assistant_message("Hello", "length", _plan(tools=[WEATHER]))[1] == "length"


# -- the clients against the app --------------------------------------------------------------------------
def _sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0)


def _ask(tool_choice, **extra) -> dict:
    return dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0,
                max_tokens=32, parallel_tool_calls=False, **extra)


@pytest.mark.parametrize(("tool_choice", "expected"), [(NAMED, "stop"), ("required", "tool_calls")])
def test_openai_sdk_create_stream_and_helpers(server, tool_choice, expected):
    sdk = _sdk(server)
    whole = sdk.chat.completions.create(**_ask(tool_choice)).choices[0]
    assert whole.finish_reason == expected and whole.message.content is None
    calls = whole.message.tool_calls
    assert calls and all(call.function.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)
    arguments = [call.function.arguments for call in calls]

    chunks = [c.choices[0] for c in sdk.chat.completions.create(**_ask(tool_choice), stream=True) if c.choices]
    assert [c.finish_reason for c in chunks if c.finish_reason] == [expected]
    pieces = [p for c in chunks for p in c.delta.tool_calls or []]
    assert ["".join(p.function.arguments or "" for p in pieces if p.index == i) for i in range(len(calls))] == arguments

    with sdk.chat.completions.stream(**_ask(tool_choice)) as stream:  # the helper's done events fire on either
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [(e.name, e.arguments) for e in done] == [("get_weather", a) for a in arguments]
    assert final.choices[0].finish_reason == expected
    assert [call.function.arguments for call in final.choices[0].message.tool_calls] == arguments

def test_openai_sdk_parse_with_a_named_pydantic_tool(server):
    """`parse` raises only on "length"/"content_filter": a named call's "stop" is parsed."""
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=12)

    completion = _sdk(server).chat.completions.parse(
        model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.tool_calls[0].function.parsed_arguments, GetWeather)
    with pytest.raises(openai.LengthFinishReasonError):  # what the SDK does check
        _sdk(server).chat.completions.parse(
            model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)], temperature=0,
            max_tokens=2, tool_choice={"type": "function", "function": {"name": "GetWeather"}})


@pytest.mark.slow
def test_langchain_tool_loop_reads_calls_whatever_the_finish_reason(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.openai_url, api_key="none", model=MODEL, temperature=0, max_tokens=32,
                     max_retries=0)
    question = HumanMessage(ASK[0]["content"])
    for tool_choice, expected in (("get_weather", "stop"), ("required", "tool_calls")):
        bound = llm.bind_tools([WEATHER], tool_choice=tool_choice, parallel_tool_calls=False)
        reply = bound.invoke([question])
        assert reply.response_metadata["finish_reason"] == expected, tool_choice
        call, = reply.tool_calls
        assert call["name"] == "get_weather" and not reply.invalid_tool_calls
        jsonschema.validate(call["args"], PARAMETERS)
        streamed = None
        for chunk in bound.stream([question]):
            streamed = chunk if streamed is None else streamed + chunk
        assert streamed.response_metadata["finish_reason"] == expected
        assert [c["args"] for c in streamed.tool_calls] == [call["args"]]
    answer = llm.invoke([question, reply, ToolMessage("Sunny, 22 C", tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and answer.content
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
