"""Every TGI error kind, with TGI's body `{"error", "error_type"}` and status, as the
real clients see it; a client that goes away mid-stream; and none of these
disturbing a stream in flight."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import text_generation
from huggingface_hub import InferenceClient
from huggingface_hub import errors as hub_errors

from switchyard.core.engine.client import EngineDeadError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

COUNT = "1, 2, 3, 4,"


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in text.splitlines() if line.startswith("data:")]


def assert_tgi_error(response: httpx.Response, status: int, error_type: str, fragment: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"}, body
    assert body["error_type"] == error_type
    assert fragment in body["error"], body
    return body


@pytest.fixture(scope="module")
def small(start_server):
    """A server with --max-total-tokens 32 (so --max-input-tokens 31)."""
    return start_server(max_total_tokens=32)


VALIDATION_CASES = [
    ({"temperature": -1.0}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 0.0}, "`top_p` must be > 0.0"),
    ({"top_p": 1.5}, "`top_p` must be > 0.0"),
    ({"typical_p": 0.0}, "`typical_p` must be > 0.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"truncate": 0}, "`truncate` must be strictly positive"),
    ({"grammar": {"type": "regex", "value": "[a-"}}, "invalid regex"),
    ({"grammar": {"type": "json", "value": {"type": "nope"}}}, "invalid JSON schema"),
    ({"adapter_id": "my-lora"}, "LoRA adapters are not supported"),
]


@pytest.mark.parametrize("parameters,message", VALIDATION_CASES,
                         ids=[next(iter(p)) + str(i) for i, (p, _) in enumerate(VALIDATION_CASES)])
def test_validation_errors(server, http, parameters, message):
    before = server.app.state.metrics.request_input_length.count()
    r = http.post("/generate", json={"inputs": COUNT, "parameters": {"max_new_tokens": 2, **parameters}})
    body = assert_tgi_error(r, 422, "validation", message)
    assert body["error"].startswith("Input validation error: ")
    assert server.app.state.metrics.request_input_length.count() == before  # the engine never saw it


def test_validation_errors_of_streams_are_http_errors(http):
    r = http.post("/generate_stream", json={"inputs": COUNT, "parameters": {"best_of": 2, "do_sample": True}})
    assert_tgi_error(r, 422, "validation", "`best_of` != 1 is not supported when streaming tokens")
    r = http.post("/", json={"inputs": COUNT, "stream": True, "parameters": {"decoder_input_details": True}})
    assert_tgi_error(r, 422, "validation", "`decoder_input_details` == true is not supported when streaming")
    r = http.post("/generate", json={"inputs": "", "parameters": {"max_new_tokens": 2}})
    assert_tgi_error(r, 422, "validation", "`inputs` cannot be empty")


def test_lengths_are_checked_before_the_engine(small):
    before = small.app.state.metrics.request_input_length.count()
    long_input = " ".join(["word"] * 40)
    r = httpx.post(small.base_url + "/generate", json={"inputs": long_input, "parameters": {"max_new_tokens": 1}})
    assert_tgi_error(r, 422, "validation", "`inputs` tokens must be <= 31")
    r = httpx.post(small.base_url + "/generate", json={"inputs": COUNT, "parameters": {"max_new_tokens": 30}})
    assert_tgi_error(r, 422, "validation", "`inputs` tokens + `max_new_tokens` must be <= 32")
    r = httpx.post(small.base_url + "/generate", json={"inputs": COUNT, "parameters": {"truncate": 40}})
    assert_tgi_error(r, 422, "validation", "`truncate` must be strictly positive and less than 31. Given: 40")
    assert small.app.state.metrics.request_input_length.count() == before
    client = text_generation.Client(small.base_url)
    with pytest.raises(text_generation.errors.ValidationError, match="must be <= 31"):
        client.generate(long_input, max_new_tokens=1)
    with pytest.raises(hub_errors.ValidationError, match="must be <= 31"):
        InferenceClient(base_url=small.base_url).text_generation(long_input, max_new_tokens=1)


def test_malformed_bodies_name_the_field(http):
    r = http.post("/generate", content=b'{"inputs": "x", ', headers={"content-type": "application/json"})
    assert_tgi_error(r, 422, "validation", "not valid JSON")
    r = http.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": "many"}})
    assert_tgi_error(r, 422, "validation", "parameters.max_new_tokens")
    r = http.post("/generate", json={"parameters": {"max_new_tokens": 2}})
    assert_tgi_error(r, 422, "validation", "inputs")
    r = http.post("/generate", json={"inputs": "x", "parameters": {"stop": [1, 2]}})
    assert_tgi_error(r, 422, "validation", "parameters.stop.0")
    r = http.post("/invocations", content=b"[1,", headers={"content-type": "application/json"})
    assert_tgi_error(r, 422, "validation", "not valid JSON")
    r = http.post("/invocations", json={"inputs": "x", "parameters": {"seed": -1}})
    assert_tgi_error(r, 422, "validation", "parameters.seed")


def test_payload_too_large(start_server):
    limited = start_server(payload_limit=2_000)
    r = httpx.post(limited.base_url + "/generate", json={"inputs": "x" * 5_000})
    assert_tgi_error(r, 413, "payload_too_large")


def test_bad_api_key(start_server):
    locked = start_server(api_key="sesame")
    r = httpx.post(locked.base_url + "/generate", json={"inputs": COUNT})
    assert r.status_code == 401
    r = httpx.post(locked.base_url + "/generate_stream", json={"inputs": COUNT},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(locked.base_url + "/info").status_code == 200  # open, as in TGI
    client = text_generation.Client(locked.base_url, headers={"Authorization": "Bearer sesame"})
    assert client.generate(COUNT, max_new_tokens=2).details.generated_tokens == 2
    assert InferenceClient(base_url=locked.base_url, api_key="sesame").text_generation(COUNT, max_new_tokens=2)


def test_overloaded(start_server):
    busy = start_server(max_concurrent_requests=1)
    body = {"inputs": COUNT, "parameters": {"max_new_tokens": 200}}
    with httpx.stream("POST", busy.base_url + "/generate_stream", json=body, timeout=60) as held:
        lines = held.iter_lines()  # keep a reference: a collected iterator closes the response
        assert next(lines).startswith("data:")
        r = httpx.post(busy.base_url + "/generate", json={"inputs": COUNT, "parameters": {"max_new_tokens": 1}})
        assert_tgi_error(r, 429, "overloaded", "Model is overloaded")
        assert int(r.headers["retry-after"]) >= 1
        r = httpx.post(busy.base_url + "/generate_stream", json={"inputs": COUNT})
        assert_tgi_error(r, 429, "overloaded")
        with pytest.raises(text_generation.errors.OverloadedError):
            text_generation.Client(busy.base_url).generate(COUNT, max_new_tokens=1)
    busy.wait_idle()  # leaving the stream aborted its request and freed its blocks
    deadline = time.monotonic() + 10
    while (r := httpx.post(busy.base_url + "/generate", json={"inputs": COUNT, "parameters": {
            "max_new_tokens": 1}})).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 200
    assert busy.app.state.metrics.request_failure.value(err="overloaded") == 3


class _FailingStream:
    """A real stream that fails with EngineDeadError after `ok` outputs."""

    def __init__(self, stream, ok: int):
        self._stream = stream
        self._ok = ok

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._ok == 0:
            self._stream.abort()
            raise EngineDeadError("the engine step failed (injected)")
        self._ok -= 1
        return await self._stream.__anext__()


class _FailingClient:
    """The engine client, but requests fail: at once (ok=None) or after `ok` outputs."""

    def __init__(self, client, ok: int | None):
        self._client = client
        self._ok = ok

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def add_requests(self, requests):
        if self._ok is None:
            raise EngineDeadError("the engine is gone (injected)")
        return [_FailingStream(stream, self._ok) for stream in await self._client.add_requests(requests)]


def test_generation_error(start_server):
    broken = start_server()
    broken.app.state.service.client = _FailingClient(broken.client, ok=None)
    r = httpx.post(broken.base_url + "/generate", json={"inputs": COUNT, "parameters": {"max_new_tokens": 2}})
    body = assert_tgi_error(r, 424, "generation", "the engine is gone")
    assert body["error"].startswith("Request failed during generation: ")
    with pytest.raises(text_generation.errors.GenerationError):
        text_generation.Client(broken.base_url).generate(COUNT, max_new_tokens=2)
    with pytest.raises(hub_errors.GenerationError):
        InferenceClient(base_url=broken.base_url).text_generation(COUNT, max_new_tokens=2)
    assert broken.app.state.metrics.request_failure.value(err="generation") == 3


def test_generation_error_mid_stream(start_server):
    broken = start_server()
    broken.app.state.service.client = _FailingClient(broken.client, ok=2)
    r = httpx.post(broken.base_url + "/generate_stream", json={"inputs": COUNT, "parameters": {"max_new_tokens": 8}})
    assert r.status_code == 200  # the stream had started
    events = sse_events(r.text)
    assert len(events) == 3 and "token" in events[0] and "token" in events[1]
    assert events[2] == {"error": "Request failed during generation: the engine step failed (injected)",
                         "error_type": "generation"}
    with pytest.raises(text_generation.errors.GenerationError):
        list(text_generation.Client(broken.base_url).generate_stream(COUNT, max_new_tokens=8))
    broken.wait_idle()


def test_client_disconnect_aborts_and_frees_blocks(server):
    metrics = server.app.state.metrics
    aborted = metrics.requests_aborted.value()
    body = {"inputs": COUNT, "parameters": {"max_new_tokens": 500}}
    with httpx.stream("POST", server.base_url + "/generate_stream", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(lines)
        assert server.kv_blocks_in_use() > 0
    server.wait_idle(timeout=10)
    assert server.kv_blocks_in_use() == 0
    deadline = time.monotonic() + 5
    while metrics.requests_aborted.value() == aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metrics.requests_aborted.value() == aborted + 1
    assert metrics.request_failure.value(err="incomplete_generation") >= 1


def test_client_disconnect_during_generate_aborts(server):
    """Not streamed: the server notices the client went away and aborts the request."""
    failures = server.app.state.metrics.request_failure.value(err="incomplete_generation")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/generate", json={"inputs": COUNT, "parameters": {"max_new_tokens": 500}},
                   timeout=1.0)
    server.wait_idle(timeout=10)  # 500 tokens would take far longer
    assert server.app.state.metrics.request_failure.value(err="incomplete_generation") == failures + 1


@pytest.mark.slow
def test_errors_do_not_disturb_a_stream_in_flight(server, small, start_server, http):
    """A greedy stream runs while every kind of error happens around it; its text is
    the same as when it runs alone."""
    body = {"inputs": COUNT, "parameters": {"max_new_tokens": 16}}
    alone = http.post("/generate", json=body).json()["generated_text"]
    result = {}

    def run_stream():
        result["events"] = sse_events(httpx.post(server.base_url + "/generate_stream", json=body, timeout=120).text)

    thread = threading.Thread(target=run_stream)
    thread.start()
    time.sleep(0.1)
    assert_tgi_error(http.post("/generate", json={"inputs": COUNT, "parameters": {"top_k": 0}}), 422, "validation")
    assert_tgi_error(http.post("/generate", content=b"{", headers={"content-type": "application/json"}),
                     422, "validation")
    assert_tgi_error(httpx.post(small.base_url + "/generate", json={"inputs": "word " * 40}), 422, "validation")
    with httpx.stream("POST", server.base_url + "/generate_stream", json=body, timeout=60) as other:
        lines = other.iter_lines()
        assert next(lines).startswith("data:")  # then the client goes away mid-stream
    thread.join(timeout=120)
    assert result["events"][-1]["generated_text"] == alone
    server.wait_idle()
