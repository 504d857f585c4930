"""Reliability leftovers (issue 26): a gateway that listens at once, answering 503 with
Retry-After in the route's dialect while the engine loads; "the engine stopped" and exit
status 1 (not death by its own SIGTERM) after an engine death; a JSON error, not a
plain-text 500, for a request still waiting at the drain deadline; a 503, not a 400 blaming
the request, when no grammar worker starts; a small schema that does not wait behind heavy
compiles, and a self-recursive one that is answered at once."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from openai_reference import MODEL_NAME
from reliability_servers import serve_draining, start_tiny, tiny_engine

from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.config import CacheConfig, EngineConfig, GrammarConfig, ModelConfig
from switchyard.core.engine.process import ProcessEngineClient
from switchyard.gateway.app import create_app
from switchyard.gateway.settings import ServerSettings
from switchyard.core.testing.serving import free_port

TINY_FLAGS = ("--model-id", "llama-tiny", "--load-format", "dummy", "--max-batch-total-tokens", "512",
              "--dtype", "float32", "--enforce-eager")
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _assert_503(response: httpx.Response, dialect: str, fragment: str) -> None:
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    assert int(response.headers["retry-after"]) >= 1
    body = response.json()
    if dialect == "openai":
        assert body["error"]["type"] == "service_unavailable" and fragment in body["error"]["message"], body
        assert body["error"]["param"] is None  # nothing in the request is to blame
    else:
        assert body["error_type"] == "unavailable" and fragment in body["error"], body


# -- start-up and an engine death, as a user runs `switchyard serve` ------------------------------
@pytest.mark.slow  # one server start (the engine's torch import, twice: its re-execution)
def test_serve_listens_at_once_then_exits_1_after_an_engine_death():
    from test_engine_process_serve import _engine_pid

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--port", str(port), *TINY_FLAGS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        while True:
            assert proc.poll() is None, "".join(log)
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                time.sleep(0.02)
        listening_s = time.monotonic() - started
        loading = [httpx.get(url + "/health", timeout=5),
                   httpx.post(url + "/generate", json={"inputs": "Hi"}, timeout=5),
                   httpx.post(url + "/v1/completions", json={"model": "llama-tiny", "prompt": "Hi"}, timeout=5)]
        checked = "".join(log)
        print(f"listening {listening_s:.2f} s after the start")
        # answered before the engine had even checked the model (its log line comes later)
        assert "switchyard.serve: listening on http://127.0.0.1" in checked, checked
        assert "switchyard.serve: model " not in checked, checked
        assert loading[0].status_code == 503 and loading[0].json()["error_type"] == "healthcheck"
        _assert_503(loading[1], "tgi", "still loading")
        _assert_503(loading[2], "openai", "still loading")

        deadline = time.monotonic() + 600
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            time.sleep(0.1)
        assert httpx.post(url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                          timeout=60).status_code == 200
        os.kill(_engine_pid(proc.pid), signal.SIGKILL)
        # non-zero and no signal: systemd's Restart=on-failure restarts it
        assert proc.wait(60) == 1, "".join(log)
        reader.join(10)
        assert "the engine process ended (exit code -9)" in "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow  # an engine process starts
def test_after_an_engine_death_requests_get_503_the_engine_stopped():
    config = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy"),
                          cache=CacheConfig(num_blocks=64))
    client = ProcessEngineClient(config)
    client.start()
    try:
        asyncio.run(client.wait_ready(timeout=600))
        http = TestClient(create_app(ServerSettings(model_id="m"), client))  # no lifespan: it stays up
        assert http.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
        os.kill(client.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while client.failure is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _assert_503(http.post("/generate", json={"inputs": "Hi"}), "tgi", "the engine stopped")
        _assert_503(http.post("/v1/completions", json={"model": "m", "prompt": "Hi"}), "openai",
                    "the engine stopped")
        assert "still loading" not in http.post("/generate", json={"inputs": "Hi"}).text
    finally:
        asyncio.run(client.shutdown())


# -- the drain deadline --------------------------------------------------------------------------
class _StalledCompiles:
    """Holds every grammar compile of an engine client until released (the slowest compile
    one could write, without spending the CPU)."""

    def __init__(self, client):
        self.release = asyncio.Event()
        self.waiting = threading.Event()
        real = client.compile_grammar

        async def compile_grammar(spec):
            self.waiting.set()
            await self.release.wait()
            await real(spec)

        client.compile_grammar = compile_grammar


@pytest.fixture(scope="module")
def tiny_client():
    client = InProcessEngineClient(tiny_engine)
    client.start()
    asyncio.run(client.wait_ready(timeout=120))
    yield client
    asyncio.run(client.shutdown())


@pytest.mark.parametrize("path,body,dialect", [
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 4,
                                                  "grammar": {"type": "regex", "value": "[a-z]{3}"}}}, "tgi"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                              "response_format": {"type": "json_object"}}, "openai"),
])
def test_a_request_still_waiting_at_the_drain_deadline_gets_a_json_error(tiny_client, path, body, dialect):
    stalled = _StalledCompiles(tiny_client)
    server, thread, url = serve_draining(tiny_client, grace_s=2.0)
    answers = []
    request = threading.Thread(target=lambda: answers.append(httpx.post(url + path, json=body, timeout=30)))
    try:
        request.start()
        assert stalled.waiting.wait(30)
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        request.join(30)
        thread.join(30)
        _assert_503(answers[0], dialect, "did not finish by the drain deadline")
    finally:
        del tiny_client.compile_grammar  # the real one again
        server.should_exit = True
        thread.join(10)


# -- grammar workers that do not start, the compile queue ---------------------------------------
def test_a_grammar_worker_that_does_not_start_is_a_503_not_the_request_s_fault():
    """The worker must answer within a millisecond: it cannot, so no compile can run."""
    grammar = GrammarConfig(worker_start_timeout_s=0.001, num_compile_workers=1)
    with start_tiny(grammar=grammar) as server:
        chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": "default", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 8,
            "tools": [WEATHER], "tool_choice": "required"})
        _assert_503(chat, "openai", "did not start")
        assert "tools" not in chat.json()["error"]["message"]
        generate = httpx.post(server.base_url + "/generate", timeout=60, json={
            "inputs": "Hi", "parameters": {"max_new_tokens": 4, "grammar": {"type": "regex", "value": "[a-z]+"}}})
        _assert_503(generate, "tgi", "did not start")
        server.wait_idle()


def test_serve_compiles_grammars_on_more_than_one_worker_where_there_are_cores():
    from switchyard.core.config import default_compile_workers
    from switchyard.core.params import ValidationError
    from switchyard.gateway.cli import build_parser
    from switchyard.gateway.serve import engine_config

    grammar = engine_config(build_parser({}).parse_args(["serve"])).grammar
    assert grammar.compile_workers == default_compile_workers() == min(2, len(os.sched_getaffinity(0)))
    assert grammar.spare_max_spec_bytes > 0  # and the warm spare for small ones
    assert engine_config(build_parser({"GRAMMAR_WORKERS": "3"}).parse_args(["serve"])).grammar.compile_workers == 3
    with pytest.raises(ValidationError, match="--grammar-workers must be at least 1"):
        engine_config(build_parser({}).parse_args(["serve", "--grammar-workers", "0"]))


def test_a_self_recursive_required_ref_is_answered_with_a_400_at_once():
    with start_tiny() as server:
        start = time.monotonic()
        response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": "default", "messages": [{"role": "user", "content": "A list"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "chain", "schema": ENDLESS}}})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "no finite instance" in error["message"] and error["param"] == "response_format"
        assert time.monotonic() - start < 30  # no worker needed: well within the compile timeout
        server.wait_idle()


def _heavy_schema(seed: int, size: int = 10_500) -> dict:
    """~250 KB, just under --grammar-max-spec-bytes (seeds under 10,000): seconds to compile on
    the default model's 49k-token vocabulary (benchmarks/grammar_queue.py times the same shape)."""
    return {"type": "object", "properties": {"pick": {"enum": [f"s{seed}-item-{i:06d}-{'x' * (i % 7)}"
                                                              for i in range(size)]}}, "required": ["pick"]}


def _chat(schema: dict) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


@pytest.mark.slow  # two heavy compiles on the default model's vocabulary; figures: benchmarks/grammar_queue.py
def test_a_trivial_schema_is_answered_while_two_heavy_ones_still_compile(server):
    service = server.client.engine.grammar_service
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        # the workers are up (the first compile starts them), as on a server that has served a grammar
        assert http.post("/v1/chat/completions", json=_chat({"type": "object", "properties": {
            "warm": {"type": "integer"}}, "required": ["warm"]})).status_code == 200
        heavy: list[httpx.Response] = []
        seed = time.monotonic_ns() % 10_000  # schemas no earlier compile has cached
        threads = [threading.Thread(target=lambda s=s: heavy.append(http.post("/v1/chat/completions",
                                                                                json=_chat(_heavy_schema(s)))))
                   for s in (seed, seed + 1)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while service.num_pending < 2:  # both heavy schemas have reached the compile queue
            assert time.monotonic() < deadline and not heavy, [r.text[:200] for r in heavy]
            time.sleep(0.01)
        start = time.monotonic()
        trivial = http.post("/v1/chat/completions", json=_chat({"type": "object", "properties": {
            "answer": {"type": "string", "maxLength": 8}}, "required": ["answer"]}))
        still_compiling, answered_s = service.num_pending, time.monotonic() - start
        print(f"the trivial schema answered in {answered_s:.2f} s, {still_compiling} heavy ones still compiling")
        assert trivial.status_code == 200 and json.loads(trivial.json()["choices"][0]["message"]["content"])
        assert still_compiling == 2 and not heavy, f"the trivial schema waited for a heavy compile ({answered_s:.2f} s)"
        for thread in threads:
            thread.join(300)
        for response in heavy:  # compiled, or (on a busy machine) past the compile time limit
            assert response.status_code == 200 or "took longer than" in response.text, response.text[:300]
