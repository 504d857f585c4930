"""POST /v1/messages driven by the real anthropic SDK: the greedy answer equal to the OpenAI
chat route's for the same conversation (one prompt, the same tokens), whole and streamed
(`messages.stream`: its text, its events in Anthropic's order, its final message), each
stop_reason (end_turn, max_tokens, stop_sequence with the one met, and
model_context_window_exceeded when max_tokens is past the context), usage with the prefix
cache's share, and /v1/messages/count_tokens."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from openai_reference import MODEL_NAME, greedy_chat

SYSTEM = "You are terse."
QUESTION = "Name three colours."
MESSAGES = [{"role": "user", "content": QUESTION}]
CHAT_MESSAGES = [{"role": "system", "content": SYSTEM}, *MESSAGES]
# the SDK no longer takes sampling arguments; the server reads them, as llama.cpp and vLLM do
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


def _chat_answer(chat, messages, max_tokens, **extra):
    return chat.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
                                        **extra)


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_greedy_answer_equals_the_chat_routes_whole_and_streamed(client, chat):
    expected = _chat_answer(chat, CHAT_MESSAGES, 12)
    message = client.messages.create(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=12,
                                     **GREEDY)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL_NAME
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.choices[0].message.content
    assert message.stop_reason == ("max_tokens" if expected.choices[0].finish_reason == "length" else "end_turn")
    assert message.stop_sequence is None
    assert message.usage.output_tokens == expected.usage.completion_tokens
    assert _prompt_tokens(message.usage) == expected.usage.prompt_tokens

    with client.messages.stream(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=12,
                                **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == message.content[0].text
    kinds = [e.type for e in events if e.type not in ("text", "content_block_delta")]  # "text": the SDK's own
    assert kinds == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason == message.stop_reason and final.id.startswith("msg_")
    assert final.usage.output_tokens == message.usage.output_tokens
    assert _prompt_tokens(final.usage) == expected.usage.prompt_tokens


def test_the_raw_stream_is_anthropics_event_sequence(server):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        response = http.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: "):] for line in response.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6) and len(names) > 6
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_end_turn_when_the_model_finishes(client, server):
    messages = [{"role": "user", "content": "Say hello."}]
    expected = greedy_chat(server, messages, max_tokens=64)
    assert expected.finish_reason == "stop"  # the model ends this answer itself
    message = client.messages.create(model=MODEL_NAME, messages=messages, max_tokens=64, **GREEDY)
    assert message.stop_reason == "end_turn" and message.content[0].text == expected.text
    assert message.usage.output_tokens == len(expected.token_ids)


def test_max_tokens_stop_reason_whole_and_streamed(client):
    messages = [{"role": "user", "content": "Count from 1 to 50."}]
    message = client.messages.create(model=MODEL_NAME, messages=messages, max_tokens=3, **GREEDY)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    with client.messages.stream(model=MODEL_NAME, messages=messages, max_tokens=3, **GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.content[0].text == message.content[0].text


def test_stop_sequences_end_the_text_and_name_the_one_met(client, server):
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    expected = greedy_chat(server, messages, max_tokens=40)
    stop = expected.text[8:11]
    assert stop.strip() and stop in expected.text
    before = expected.text[:expected.text.index(stop)]
    later = expected.text[20:23]  # met later in the answer: the first met wins, whatever the order
    assert expected.text.index(later) > expected.text.index(stop)
    sequences = ["never in the answer", later, stop]
    message = client.messages.create(model=MODEL_NAME, messages=messages, max_tokens=40, **GREEDY,
                                     stop_sequences=sequences)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == before
    with client.messages.stream(model=MODEL_NAME, messages=messages, max_tokens=40, **GREEDY,
                                stop_sequences=sequences) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop, before)


def test_max_tokens_past_the_context_is_fitted_into_it(start_server):
    small = start_server(max_input_tokens=60, max_total_tokens=64)
    client = anthropic.Anthropic(base_url=small.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Count from 1 to 50."}]
    room = 64 - client.messages.count_tokens(model=MODEL_NAME, messages=messages).input_tokens
    message = client.messages.create(model=MODEL_NAME, messages=messages, max_tokens=32000, timeout=120, **GREEDY)
    assert message.stop_reason == "model_context_window_exceeded" and message.usage.output_tokens == room
    with client.messages.stream(model=MODEL_NAME, messages=messages, max_tokens=32000, **GREEDY) as stream:
        assert stream.get_final_message().stop_reason == "model_context_window_exceeded"
    within = client.messages.create(model=MODEL_NAME, messages=messages, max_tokens=room, **GREEDY)
    assert within.stop_reason == "max_tokens" and within.content[0].text == message.content[0].text


def test_repeated_prompt_reports_the_cache_read(client):
    messages = [{"role": "user", "content": "Describe the sea in one long sentence, please, with many words."}]
    first = client.messages.create(model=MODEL_NAME, messages=messages, max_tokens=2, **GREEDY)
    again = client.messages.create(model=MODEL_NAME, messages=messages, max_tokens=2, **GREEDY)
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=messages).input_tokens
    assert _prompt_tokens(first.usage) == _prompt_tokens(again.usage) == counted
    assert again.usage.cache_read_input_tokens > 0 and again.usage.input_tokens < counted


def test_count_tokens_is_the_chat_routes_prompt(client, chat):
    counted = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == _chat_answer(chat, CHAT_MESSAGES, 1).usage.prompt_tokens
    system_blocks = [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]
    block_messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    assert client.messages.count_tokens(model=MODEL_NAME, system=system_blocks,
                                        messages=block_messages).input_tokens == counted.input_tokens
    without_system = client.messages.count_tokens(model=MODEL_NAME, messages=MESSAGES).input_tokens
    assert without_system == _chat_answer(chat, MESSAGES, 1).usage.prompt_tokens != counted.input_tokens


def test_claude_codes_billing_header_block_is_left_out_of_the_prompt(client):
    header = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0.0; cch=1a2b3;"}
    plain = client.messages.count_tokens(model=MODEL_NAME, system=[{"type": "text", "text": SYSTEM}],
                                         messages=MESSAGES)
    with_header = client.messages.count_tokens(model=MODEL_NAME, system=[header, {"type": "text", "text": SYSTEM}],
                                               messages=MESSAGES)
    assert with_header.input_tokens == plain.input_tokens


def test_thinking_and_metadata_are_accepted_and_no_thinking_block_comes_back(client):
    message = client.messages.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                     thinking={"type": "enabled", "budget_tokens": 1024},
                                     metadata={"user_id": "someone"}, output_config={"effort": "low"},
                                     extra_body={"temperature": 0.5, "top_k": 5, "top_p": 0.9})
    assert [block.type for block in message.content] == ["text"]


def test_placeholder_model_names_mean_the_served_model(client):
    assert client.messages.create(model="default", messages=MESSAGES, max_tokens=1).model == MODEL_NAME
