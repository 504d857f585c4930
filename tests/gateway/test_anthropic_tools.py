"""Tools on /v1/messages through the real anthropic SDK: `tool_choice` `tool` and `any` on
the grammar-enforced path (tool_use blocks with `toolu_` ids and a parsed `input`,
stop_reason `tool_use`, whole and streamed as input_json_delta), `auto` read as the chat
route reads it, a tool round trip (tool_use, then a tool_result turn) whose prompt and
greedy answer are the chat route's for the same conversation, and `output_config.format`
(`messages.parse` with a pydantic model)."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest
from openai_reference import MODEL_NAME
from pydantic import BaseModel, Field

GREEDY = {"extra_body": {"temperature": 0}}
QUESTION = "What is the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": SCHEMA}}


class Capital(BaseModel):
    country: str = Field(max_length=20)
    capital: str = Field(max_length=20)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


def _ask(client, max_tokens: int = 60, **fields):
    return client.messages.create(model=MODEL_NAME, max_tokens=max_tokens, tools=[WEATHER], **GREEDY, **fields)


def test_named_tool_choice_whole_and_streamed(client):
    message = _ask(client, messages=[{"role": "user", "content": QUESTION}],
                   tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert set(block.input) == {"city"} and isinstance(block.input["city"], str)

    with client.messages.stream(model=MODEL_NAME, max_tokens=60, tools=[WEATHER], **GREEDY,
                                messages=[{"role": "user", "content": QUESTION}],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert pieces and all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")
    assert json.loads("".join(pieces)) == block.input
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    assert final.stop_reason == "tool_use" and final.content[0].input == block.input
    assert final.content[0].id == start.content_block.id.strip() and final.content[0].id.startswith("toolu_")


def test_any_tool_choice_forces_calls_one_when_parallel_is_off(client):
    message = _ask(client, messages=[{"role": "user", "content": QUESTION}],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    assert message.content[0].name == "get_weather" and set(message.content[0].input) == {"city"}
    with client.messages.stream(model=MODEL_NAME, max_tokens=60, tools=[WEATHER], **GREEDY,
                                messages=[{"role": "user", "content": QUESTION}],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == message.content[0].input


@pytest.mark.parametrize("question", [QUESTION, "Say hello."])
def test_auto_answers_as_the_chat_route_reads_the_same_output(client, chat, question):
    message = _ask(client, messages=[{"role": "user", "content": question}])
    expected = chat.chat.completions.create(model=MODEL_NAME, max_tokens=60, temperature=0, tools=[CHAT_WEATHER],
                                            messages=[{"role": "user", "content": question}]).choices[0]
    calls = expected.message.tool_calls or []
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert "".join(b.text for b in message.content if b.type == "text") == (expected.message.content or "")
    if calls:
        assert message.stop_reason == "tool_use"
    else:
        assert message.stop_reason == ("max_tokens" if expected.finish_reason == "length" else "end_turn")


def test_tool_round_trip_is_the_chat_routes_conversation(client, chat):
    first = _ask(client, messages=[{"role": "user", "content": QUESTION}],
                 tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = first.content
    turns = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    answer = _ask(client, messages=turns, tool_choice={"type": "none"}, max_tokens=20)
    assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]

    chat_turns = [{"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    expected = chat.chat.completions.create(model=MODEL_NAME, max_tokens=20, temperature=0, tools=[CHAT_WEATHER],
                                            tool_choice="none", messages=chat_turns)
    assert answer.content[0].text == expected.choices[0].message.content
    assert answer.usage.output_tokens == expected.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=turns, tools=[WEATHER],
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == expected.usage.prompt_tokens


def test_a_failed_tool_result_says_so_in_the_prompt(client):
    def turns(is_error: bool) -> list[dict]:
        call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city", "is_error": is_error}
        return [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]}]

    ok = client.messages.count_tokens(model=MODEL_NAME, messages=turns(False), tools=[WEATHER]).input_tokens
    failed = client.messages.count_tokens(model=MODEL_NAME, messages=turns(True), tools=[WEATHER]).input_tokens
    assert failed > ok


def test_tools_are_in_the_counted_prompt(client, chat):
    messages = [{"role": "user", "content": QUESTION}]
    with_tools = client.messages.count_tokens(model=MODEL_NAME, messages=messages, tools=[WEATHER]).input_tokens
    without = client.messages.count_tokens(model=MODEL_NAME, messages=messages).input_tokens
    expected = chat.chat.completions.create(model=MODEL_NAME, max_tokens=1, messages=messages, tools=[CHAT_WEATHER])
    assert with_tools == expected.usage.prompt_tokens > without


@pytest.mark.slow
def test_output_config_format_holds_the_answer_to_the_schema(client):
    question = "What is the capital of France? Answer in JSON."
    parsed = client.messages.parse(model=MODEL_NAME, max_tokens=60, messages=[{"role": "user", "content": question}],
                                   output_format=Capital, **GREEDY)
    assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, Capital)
    assert Capital.model_validate_json(parsed.content[0].text) == parsed.parsed_output


def _sse(events: list[str]) -> list[dict]:
    return [json.loads(event.split("data: ", 1)[1]) for event in events]


@pytest.mark.parametrize(("pieces", "blocks"), [
    (['{"name": "get_weather", ', '"arguments": {"city": "Paris"}}'], [("tool_use", {"city": "Paris"})]),
    (["It is ", "sunny."], [("text", "It is sunny.")]),
])
def test_an_auto_answer_streams_as_a_tool_use_block_once_it_is_read_as_a_call(pieces, blocks):
    """`auto` holds an answer that may be a call until it ends (the small model here writes none)."""
    from switchyard.core.scheduling.request import FinishReason, RequestOutput
    from switchyard.gateway.anthropic.output import MessageFrame
    from switchyard.gateway.anthropic.stream import MessageEvents
    from switchyard.gateway.openai.schemas import ChatCompletionRequest
    from switchyard.gateway.openai.tools import tool_plan
    from switchyard.gateway.settings import ServerSettings

    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": QUESTION}],
                                                 "tools": [CHAT_WEATHER]})
    events = MessageEvents(MessageFrame(MODEL_NAME), tool_plan(chat, ServerSettings(model_id=MODEL_NAME)), 10,
                           False, [], tokenizer=None)
    sent = events.head()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        sent += events.on_output(0, RequestOutput("r", (i,), piece, last, FinishReason.EOS if last else None, 10,
                                                  i + 1))
    payloads = _sse(sent + events.tail())
    kinds = [p["type"] for p in payloads]
    assert kinds == ["message_start", "ping", "content_block_start", *["content_block_delta"] * (kinds.count(
        "content_block_delta")), "content_block_stop", "message_delta", "message_stop"]
    start = payloads[2]["content_block"]
    deltas = [p["delta"] for p in payloads if p["type"] == "content_block_delta"]
    (kind, value), = blocks
    assert start["type"] == kind
    if kind == "tool_use":
        assert start["name"] == "get_weather" and start["id"].startswith("toolu_")
        assert json.loads("".join(d["partial_json"] for d in deltas)) == value
        assert payloads[-2]["delta"]["stop_reason"] == "tool_use"
    else:
        assert "".join(d["text"] for d in deltas) == value and payloads[-2]["delta"]["stop_reason"] == "end_turn"
    assert payloads[-2]["usage"]["output_tokens"] == len(pieces)


def test_auto_or_none_without_tools_is_no_tools(client):
    messages = [{"role": "user", "content": QUESTION}]
    plain = client.messages.count_tokens(model=MODEL_NAME, messages=messages).input_tokens
    for kind in ("auto", "none"):
        assert client.messages.count_tokens(model=MODEL_NAME, messages=messages, tools=[],
                                            tool_choice={"type": kind}).input_tokens == plain
