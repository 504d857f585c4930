"""Every error on /v1/messages in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with the status the anthropic SDK maps to its exception: bad input (400
invalid_request_error, naming the Anthropic field), authentication (401; the key as
x-api-key or Bearer), unknown models and routes (404 not_found_error), a body too large
(413 request_too_large), overload (529 overloaded_error with Retry-After), and an error
after the stream began as an `error` event the SDK raises."""
from __future__ import annotations

import time

import anthropic
import httpx
import pytest
from openai_reference import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _sdk(url: str, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)


def _error(response: httpx.Response, status: int, kind: str) -> str:
    """The message of an Anthropic-shaped error body of `status` and `kind`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize(("fields", "words"), [
    ({"messages": [{"role": "system", "content": "x"}]}, ["messages.0.role", "system"]),
    ({"messages": [{"role": "wizard", "content": "x"}]}, ["messages.0.role"]),
    ({"messages": []}, ["messages"]),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     ["messages.0.content.0", "image", "not supported"]),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": "The sea is"}]}, ["prefill", "messages.1"]),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                                 "input": {}}]}]}, ["tool_use", "user"]),
    ({"tools": [{"name": "f", "input_schema": {"type": "nope"}}]}, ["tools.0.input_schema"]),
    ({"tools": [{"name": "f"}]}, ["tools.0.input_schema"]),
    ({"tools": [{"input_schema": {"type": "object"}}]}, ["tools.0.name"]),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ["tools.0.type", "not supported"]),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, ["tool_choice", "other"]),
    ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, ["tool_choice.type"]),
    ({"tool_choice": {"type": "any"}}, ["tool_choice", "tools"]),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, ["stop_sequences", "4"]),
    ({"temperature": -1}, ["temperature"]),
    ({"max_tokens": 0}, ["max_tokens"]),
    ({"system": [{"type": "image"}]}, ["system.0.type"]),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, ["output_config.format"]),
    ({"mcp_servers": [{"type": "url", "url": "http://127.0.0.1:1", "name": "x"}]}, ["mcp_servers"]),
])
def test_400_bad_input_names_the_field(http, fields, words):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}
    message = _error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
    assert all(word in message for word in words), message


def test_400_through_the_sdk(server):
    with pytest.raises(anthropic.BadRequestError) as caught:
        _sdk(server.base_url).messages.create(model=MODEL_NAME, max_tokens=4,
                                              messages=[{"role": "system", "content": "x"}])
    assert caught.value.status_code == 400 and caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        _sdk(server.base_url).messages.count_tokens(model=MODEL_NAME, messages=[])


def test_400_missing_max_tokens_malformed_json_and_wrong_types(http):
    missing = _error(http.post("/v1/messages", json={"model": MODEL_NAME, "messages": MESSAGES}), 400,
                     "invalid_request_error")
    assert "max_tokens" in missing
    broken = http.post("/v1/messages", content=b'{"model": "m", "messages": [',
                       headers={"content-type": "application/json"})
    assert "JSON" in _error(broken, 400, "invalid_request_error")
    wrong = http.post("/v1/messages", json={"model": MODEL_NAME, "messages": "hello", "max_tokens": 4})
    assert _error(wrong, 400, "invalid_request_error").startswith("messages")
    no_model = http.post("/v1/messages/count_tokens", json={"messages": MESSAGES})
    assert "model" in _error(no_model, 400, "invalid_request_error")


def test_404_unknown_model_and_route(server, http):
    with pytest.raises(anthropic.NotFoundError) as caught:
        _sdk(server.base_url).messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=MESSAGES)
    assert caught.value.body["error"]["type"] == "not_found_error" and "claude-sonnet-4-5" in caught.value.message
    with pytest.raises(anthropic.NotFoundError):
        _sdk(server.base_url).messages.count_tokens(model="claude-sonnet-4-5", messages=MESSAGES)
    _error(http.post("/v1/messages/batches", json={}), 404, "not_found_error")
    _error(http.get("/v1/messages"), 405, "invalid_request_error")


def test_401_without_the_key_and_both_of_anthropics_headers_with_it(start_server):
    locked = start_server(api_key="secret")
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _sdk(locked.base_url, api_key="wrong").messages.create(model=MODEL_NAME, max_tokens=1, messages=MESSAGES)
    assert caught.value.status_code == 401 and caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        _sdk(locked.base_url, api_key="wrong").messages.count_tokens(model=MODEL_NAME, messages=MESSAGES)
    _error(httpx.post(locked.base_url + "/v1/messages", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                               "max_tokens": 1}), 401, "authentication_error")
    with_key = _sdk(locked.base_url, api_key="secret")  # x-api-key
    assert with_key.messages.create(model=MODEL_NAME, max_tokens=1, messages=MESSAGES).content
    with_token = anthropic.Anthropic(base_url=locked.base_url, api_key=None, auth_token="secret", max_retries=0)
    assert with_token.messages.count_tokens(model=MODEL_NAME, messages=MESSAGES).input_tokens > 0


def test_413_body_too_large(start_server):
    tight = start_server(payload_limit=2_000)
    with pytest.raises(anthropic.APIStatusError) as caught:
        _sdk(tight.base_url).messages.create(model=MODEL_NAME, max_tokens=1,
                                             messages=[{"role": "user", "content": "x" * 5_000}])
    assert caught.value.status_code == 413 and caught.value.body["error"]["type"] == "request_too_large"


def _events(lines, count: int) -> list[str]:
    """Up to `count` event names from one `iter_lines()` iterator (kept open)."""
    names = []
    for line in lines:
        if line.startswith("event: "):
            names.append(line[len("event: "):])
            if len(names) == count:
                break
    return names


@pytest.mark.slow
def test_529_at_once_with_retry_after_and_the_stream_goes_on(start_server):
    busy = start_server(max_concurrent_requests=1)
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 48, "temperature": 0, "stream": True}
    with httpx.Client(base_url=busy.base_url, timeout=120) as http:
        with http.stream("POST", "/v1/messages", json=body) as stream:
            lines = stream.iter_lines()
            head = _events(lines, 3)
            started = time.monotonic()
            with pytest.raises(anthropic.APIStatusError) as caught:
                _sdk(busy.base_url).messages.create(model=MODEL_NAME, max_tokens=2, messages=MESSAGES)
            assert time.monotonic() - started < 2.0  # refused at once, not queued
            rest = _events(lines, 1000)
    assert caught.value.status_code == 529 and caught.value.body["error"]["type"] == "overloaded_error"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert head == ["message_start", "ping", "content_block_start"] and rest[-1] == "message_stop"


def test_500_mid_stream_is_an_error_event_the_sdk_raises(server, monkeypatch):
    server.wait_idle()
    runner = server.client.engine.runner
    original = runner.execute
    calls = {"n": 0}

    def failing_after_a_few_steps(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected device fault")
        return original(scheduler_output)

    monkeypatch.setattr(runner, "execute", failing_after_a_few_steps)
    received = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        with _sdk(server.base_url).messages.stream(model=MODEL_NAME, max_tokens=30, messages=MESSAGES,
                                                   extra_body={"temperature": 0}) as stream:
            for event in stream:
                received.append(event.type)
    assert received[0] == "message_start" and "content_block_delta" in received
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "api_error"
    assert "generation failed" in caught.value.body["error"]["message"]
    monkeypatch.setattr(runner, "execute", original)
    server.wait_idle()


def test_every_error_kind_has_anthropics_status_and_type_whole_and_mid_stream():
    from switchyard.gateway.anthropic.errors import DIALECT, error_body, status_of
    from switchyard.gateway.errors import ErrorKind, GatewayError

    types = {"invalid_request_error", "authentication_error", "not_found_error", "request_too_large",
             "overloaded_error", "api_error"}
    for kind in ErrorKind:
        error = GatewayError(kind, "it went wrong", "field")
        body = error_body(error)
        assert body == {"type": "error", "error": {"type": body["error"]["type"], "message": "field: it went wrong"}}
        assert body["error"]["type"] in types and 400 <= status_of(error) < 600
        assert error.render(DIALECT).status_code == status_of(error)
        assert error.stream_event(DIALECT).startswith("event: error\ndata: ")
