"""POST /v1/responses driven by the real openai SDK: text equal to the engine's own
greedy answer, typed stream events, `responses.parse` and `responses.stream` with a
pydantic model, function tools (required, named, and a second turn with the tool's
output), and clear refusals of what a stateless server cannot do."""
from __future__ import annotations

import json

import openai
import pytest
from openai_reference import MODEL_NAME, greedy_chat
from pydantic import BaseModel, Field

INSTRUCTIONS = "You are terse."
QUESTION = "Name three colours."
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


class Capital(BaseModel):
    country: str = Field(max_length=20)
    capital: str = Field(max_length=20)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


def test_text_equals_the_engine_whole_and_streamed(server, client):
    expected = greedy_chat(server, MESSAGES, max_tokens=8)
    response = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=8, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_NAME
    assert response.output_text == expected.text
    assert [item.type for item in response.output] == ["message"]
    cut_off = expected.finish_reason == "length"
    assert response.status == ("incomplete" if cut_off else "completed")
    assert (response.incomplete_details.reason if cut_off else response.incomplete_details) == (
        "max_output_tokens" if cut_off else None)
    assert response.usage.input_tokens == len(expected.prompt_ids)
    assert response.usage.output_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens

    events = list(client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if cut_off else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
    assert events[-1].response.output_text == expected.text
    assert events[-1].response.usage.output_tokens == len(expected.token_ids)


def test_max_output_tokens_cut_off_is_incomplete(client):
    response = client.responses.create(model=MODEL_NAME, input="Count from 1 to 50.", max_output_tokens=3,
                                       temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_output_text_logprobs_when_included(client):
    response = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=4, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens == 4
    assert "".join(entry.token for entry in logprobs) == response.output_text
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in logprobs)
    assert logprobs[0].logprob == pytest.approx(logprobs[0].top_logprobs[0].logprob)  # greedy: the top token


@pytest.mark.slow
def test_parse_and_stream_with_a_pydantic_model(client):
    question = "What is the capital of France? Answer in JSON."
    parsed = client.responses.parse(model=MODEL_NAME, input=question, text_format=Capital, max_output_tokens=60,
                                    temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Capital)
    assert Capital.model_validate_json(parsed.output_text) == parsed.output_parsed

    with client.responses.stream(model=MODEL_NAME, input=question, text_format=Capital, max_output_tokens=60,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == parsed.output_text
    assert final.output_parsed == parsed.output_parsed


@pytest.mark.slow
def test_required_tool_call_whole_and_streamed_then_the_tools_output(client):
    question = "What is the weather in Paris?"
    response = client.responses.create(model=MODEL_NAME, input=question, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    call = response.output[0]
    assert [item.type for item in response.output] == ["function_call"] and response.status == "completed"
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    assert response.tools[0].name == "get_weather" and response.tool_choice == "required"

    events = list(client.responses.create(model=MODEL_NAME, input=question, tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=60, temperature=0, stream=True))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == done.arguments == call.arguments and done.name == "get_weather"
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments

    follow_up = client.responses.create(model=MODEL_NAME, max_output_tokens=20, temperature=0, tools=[WEATHER],
                                        tool_choice="none", input=[
                                            {"role": "user", "content": question},
                                            {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 21 C"}])
    assert follow_up.output[0].type == "message" and follow_up.output_text


def test_named_tool_choice_fills_the_arguments(client):
    response = client.responses.create(model=MODEL_NAME, input="Weather in Rome?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=40, temperature=0)
    assert [item.type for item in response.output] == ["function_call"]
    assert response.output[0].name == "get_weather" and "city" in json.loads(response.output[0].arguments)


@pytest.mark.parametrize("body, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": 3}}]}, "tools.0.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 10**7}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": []}, "input"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
])
def test_refusals_name_the_responses_field(http, body, param):
    answer = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi", **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_stored_responses_are_not_found(client, http):
    with pytest.raises(openai.NotFoundError, match="does not store"):
        client.responses.retrieve("resp_abc")
    assert http.post("/v1/responses/resp_abc/cancel").status_code == 404
    assert http.delete("/v1/responses/resp_abc").status_code == 404


def test_a_body_that_is_not_a_request_is_a_400(http):
    answer = http.post("/v1/responses", json={"model": MODEL_NAME})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input"
