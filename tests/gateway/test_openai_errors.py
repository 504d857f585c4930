"""Each error kind of the OpenAI dialect, as the SDK sees it ({"error": {message,
type, param, code}} with the status it maps to an exception), and none of them
disturbs a stream in flight."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from openai_reference import MODEL_NAME, greedy_chat

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def _sdk(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)


def _assert_error_body(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "g"}}},
     "tool_choice"),
])
def test_400_bad_parameter_names_it(server, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        _sdk(server.openai_url).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                                        **fields)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"


def test_400_on_completions_bad_parameter(server):
    with pytest.raises(openai.BadRequestError) as caught:
        _sdk(server.openai_url).completions.create(model=MODEL_NAME, prompt="x", n=2, best_of=1)
    assert caught.value.body["param"] == "best_of"


def test_400_malformed_json_and_bad_fields_name_the_problem(http):
    broken = http.post("/v1/chat/completions", content=b'{"model": "m", "messages": [',
                       headers={"content-type": "application/json"})
    assert "JSON" in _assert_error_body(broken, 400)["message"]
    wrong_type = http.post("/v1/chat/completions", json={"model": "m", "messages": "hello"})
    assert _assert_error_body(wrong_type, 400)["param"].startswith("messages")
    missing = http.post("/v1/completions", json={"model": "m"})
    error = _assert_error_body(missing, 400, "prompt")
    assert "prompt" in error["message"]
    mixed = http.post("/v1/completions", json={"prompt": ["hi", 3]})
    assert "list of token ids" in _assert_error_body(mixed, 400, "prompt")["message"]
    bad_role = http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert _assert_error_body(bad_role, 400)["param"] == "messages.0.role"


def test_400_over_long_input_before_touching_the_engine(start_server, monkeypatch):
    small = start_server(max_input_tokens=60, max_total_tokens=64)
    calls = []
    original = small.client.add_requests

    async def spy(requests):
        calls.extend(request.request_id for request in requests)
        return await original(requests)

    monkeypatch.setattr(small.client, "add_requests", spy)
    client = _sdk(small.openai_url)
    long_text = "word " * 100
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": long_text}])
    assert too_long.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as too_long_prompt:
        client.completions.create(model=MODEL_NAME, prompt=["fine", long_text])
    assert too_long_prompt.value.body["param"] == "prompt.1"
    with pytest.raises(openai.BadRequestError) as too_many_new:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=100)
    assert too_many_new.value.body["param"] == "max_tokens"
    assert calls == []
    near_the_limit = "word " * 58
    num_prompt_tokens = len(small.client.tokenizer.encode(near_the_limit))
    assert 64 - num_prompt_tokens < 16 <= 60 - num_prompt_tokens + 16
    ok = client.completions.create(model=MODEL_NAME, prompt=near_the_limit)  # the default 16, clamped
    assert ok.usage.prompt_tokens == num_prompt_tokens and len(calls) == 1
    assert ok.usage.completion_tokens <= 64 - num_prompt_tokens


def test_401_bad_or_missing_key(start_server):
    locked = start_server(api_key="secret")
    with pytest.raises(openai.AuthenticationError) as caught:
        _sdk(locked.openai_url, api_key="wrong").chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                                         max_tokens=2)
    assert caught.value.status_code == 401 and caught.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        _sdk(locked.openai_url, api_key="wrong").models.list()
    _assert_error_body(httpx.post(locked.openai_url + "/completions", json={"prompt": "x"}), 401)
    good = _sdk(locked.openai_url, api_key="secret")
    assert good.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1).choices
    assert [m.id for m in good.models.list().data] == [MODEL_NAME]


def test_404_unknown_model(server):
    client = _sdk(server.openai_url)
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(model="gpt-7", messages=MESSAGES, max_tokens=2)
    assert chat.value.body["param"] == "model" and "gpt-7" in chat.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-7", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-7")
    for placeholder in ("tgi", "default", "dummy"):  # names that mean "the served model"
        assert client.completions.create(model=placeholder, prompt="hi", max_tokens=1).model == MODEL_NAME


def test_413_payload_too_large(start_server):
    tight = start_server(payload_limit=2_000)
    with pytest.raises(openai.APIStatusError) as caught:
        _sdk(tight.openai_url).completions.create(model=MODEL_NAME, prompt="x" * 5_000)
    assert caught.value.status_code == 413
    assert caught.value.body["type"] == "invalid_request_error"


def _read_chunks(lines, count: int) -> list[dict]:
    """Up to `count` chunks from one `iter_lines()` iterator (dropping that iterator
    would close the connection: a disconnect)."""
    chunks = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
            if len(chunks) == count:
                break
    return chunks


@pytest.mark.slow
def test_429_at_once_with_retry_after_and_the_stream_goes_on(start_server):
    busy = start_server(max_concurrent_requests=1)
    expected = greedy_chat(busy, MESSAGES, max_tokens=48)  # long enough to be in flight for a while
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 48, "temperature": 0, "stream": True}
    with httpx.Client(base_url=busy.base_url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            head = _read_chunks(lines, 2)
            started = time.monotonic()
            with pytest.raises(openai.RateLimitError) as caught:
                _sdk(busy.openai_url).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
            assert time.monotonic() - started < 2.0  # refused at once, not queued
            rest = _read_chunks(lines, 1000)
    assert caught.value.status_code == 429 and caught.value.body["type"] == "rate_limit_error"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in head + rest if c["choices"])
    assert text == expected.text
    assert _sdk(busy.openai_url).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1).choices


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
    stream = _sdk(server.openai_url).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=30,
                                                             temperature=0, stream=True)
    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            received.append(chunk)
    assert received and "generation failed" in caught.value.message
    monkeypatch.setattr(runner, "execute", original)
    server.wait_idle()


@pytest.mark.slow
def test_errors_do_not_disturb_a_stream_in_flight(server):
    server.wait_idle()
    expected = greedy_chat(server, MESSAGES, max_tokens=24)
    result: dict = {}

    def stream_it():
        chunks = _sdk(server.openai_url).chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                                 max_tokens=24, temperature=0, stream=True)
        result["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    worker = threading.Thread(target=stream_it)
    worker.start()
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        bad = [http.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES, "max_tokens": 2}),
               http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
               http.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": -3}),
               http.post("/v1/completions", json={"prompt": "x" * 100_000})]
    worker.join(120)
    assert [r.status_code for r in bad] == [404, 400, 400, 400]
    assert result["text"] == expected.text


def test_a_client_that_gives_up_on_a_non_streamed_request_frees_its_blocks(server):
    server.wait_idle()
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.openai_url + "/chat/completions", json=body, timeout=1.0)
    server.wait_idle(timeout=5)  # aborted long before its 400 tokens


def test_a_client_that_leaves_a_stream_of_several_choices_frees_them_all(server):
    server.wait_idle()
    body = {"model": MODEL_NAME, "prompt": ["Once upon a time", "In a galaxy"], "n": 2, "max_tokens": 300,
            "temperature": 1.0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as stream:
            chunks = _read_chunks(stream.iter_lines(), 6)
            assert server.client.engine.scheduler.num_running == 4
    assert {c["choices"][0]["index"] for c in chunks} <= {0, 1, 2, 3}
    server.wait_idle(timeout=10)  # all four sequences aborted long before their 300 tokens
