"""Behaviour under stress, in both dialects: disconnects free their blocks, a full
server answers 429 at once, a failing step fails only its batch; none of it
disturbs other requests."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

GREEDY = {"temperature": 0.0}


def _openai_completion(base_url: str, prompt: str, max_tokens: int = 12) -> str:
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, **GREEDY}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _read_events(lines, count: int) -> list[str]:
    """The next `count` events from a live `iter_lines()` iterator. (Breaking out of a
    `for` over `response.iter_lines()` closes the connection: httpx closes the stream
    with the abandoned generator.)"""
    events = []
    while len(events) < count:
        line = next(lines)
        if line.startswith("data:"):
            events.append(line)
    return events


@pytest.mark.parametrize("dialect", ["openai", "tgi"])
def test_disconnect_mid_stream_frees_every_block_and_spares_the_neighbour(server, dialect):
    server.wait_idle()
    expected = _openai_completion(server.base_url, "The capital of France is")
    if dialect == "openai":
        path, body = "/v1/chat/completions", {"model": "default", "stream": True, "max_tokens": 400,
                                              "messages": [{"role": "user", "content": "Tell a long story."}]}
    else:
        path, body = "/generate_stream", {"inputs": "Tell a long story.", "parameters": {"max_new_tokens": 400}}
    neighbour: list[str] = []
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert len(_read_events(lines, 3)) == 3
            worker = threading.Thread(target=lambda: neighbour.append(
                _openai_completion(server.base_url, "The capital of France is")))
            worker.start()
            assert server.kv_blocks_in_use() > 0
        # the stream is closed here, long before its 400 tokens
    worker.join(120)
    server.wait_idle(timeout=20)  # the aborted request left no block behind
    assert neighbour == [expected]


def test_past_max_concurrent_requests_new_ones_get_429_at_once(start_server):
    busy = start_server(max_concurrent_requests=1)
    with httpx.Client(base_url=busy.base_url, timeout=120) as http:
        body = {"inputs": "Tell a long story.", "parameters": {"max_new_tokens": 30}}
        with http.stream("POST", "/generate_stream", json=body) as stream:
            lines = stream.iter_lines()
            first = _read_events(lines, 1)
            tgi = http.post("/generate", json={"inputs": "hi"})
            openai = http.post("/v1/completions", json={"model": "default", "prompt": "hi"})
            events = first + [line for line in lines if line.startswith("data:")]
        final = json.loads(events[-1][5:])
    assert tgi.status_code == 429 and tgi.json()["error_type"] == "overloaded"
    assert tgi.headers["retry-after"]
    assert openai.status_code == 429 and openai.json()["error"]["type"] == "rate_limit_error"
    assert openai.headers["retry-after"]
    # refused while the slot was held (not queued behind it), and the stream was not disturbed
    assert final["generated_text"] is not None and len(events) == 30
    with httpx.Client(base_url=busy.base_url, timeout=120) as http:  # and the slot is free again
        assert http.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_a_failing_step_fails_its_batch_in_the_dialect_of_each_route_then_serving_resumes(server, monkeypatch):
    server.wait_idle()
    runner = server.client.engine.runner
    original = runner.execute
    calls = {"n": 0}

    def flaky(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return original(scheduler_output)

    monkeypatch.setattr(runner, "execute", flaky)
    results = {}

    def call(name, path, body):
        results[name] = httpx.post(server.base_url + path, json=body, timeout=120)

    threads = [threading.Thread(target=call, args=("tgi", "/generate", {"inputs": "Hello", "parameters": {
        "max_new_tokens": 5}})), threading.Thread(target=call, args=("openai", "/v1/completions", {
            "model": "default", "prompt": "Hello", "max_tokens": 5}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    failed = [name for name, r in results.items() if r.status_code != 200]
    assert failed, "the injected fault reached nobody"
    for name in failed:
        r = results[name]
        if name == "tgi":
            assert r.status_code == 424 and r.json()["error_type"] == "generation"
        else:
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    monkeypatch.setattr(runner, "execute", original)
    server.wait_idle()
    assert _openai_completion(server.base_url, "Hello", 3)  # serving resumes
