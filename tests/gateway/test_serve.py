"""`switchyard serve` as a user runs it: a real process, real signals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from switchyard.core.engine.client import EngineClient
from switchyard.gateway.app import create_app
from switchyard.gateway.settings import ServerSettings
from switchyard.core.testing.serving import free_port


class _LoadingClient(EngineClient):
    """An engine client whose model never finishes loading."""

    tokenizer = None
    info = None

    async def add_requests(self, requests):
        raise AssertionError("not ready")

    async def compile_grammar(self, spec):
        raise AssertionError("not ready")

    def abort(self, request_id):
        pass

    @property
    def ready(self):
        return False


def test_health_is_503_until_the_model_is_ready_and_generation_is_refused():
    app = create_app(ServerSettings(model_id="m"), _LoadingClient())
    client = TestClient(app)  # no lifespan: the client stays "loading"
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"error": "unhealthy", "error_type": "healthcheck"}
    assert response.headers["retry-after"] == "1"  # still loading: a probe may come back
    assert client.get("/metrics").status_code == 200
    assert client.post("/generate", json={"inputs": "hi"}).status_code == 503
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"


class _StoppedClient(_LoadingClient):
    """An engine client whose engine has stopped for good."""

    @property
    def failure(self):
        return RuntimeError("the engine process ended (exit code -9)")


def test_health_of_a_stopped_engine_is_503_without_retry_after():
    response = TestClient(create_app(ServerSettings(model_id="m"), _StoppedClient())).get("/health")
    assert response.status_code == 503 and "retry-after" not in response.headers


def _start(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # eager: these tests are about the server, not the decode graphs a start compiles by default
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--port", str(port),
                             "--enforce-eager", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 240) -> list[int]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            status = httpx.get(url + "/health", timeout=2).status_code
            seen.append(status)
            if status == 200:
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became healthy")


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    # a generous drain bound: on a loaded 2-core machine 20 tokens can take many seconds
    proc, url = _start("--json-output", "--max-batch-total-tokens", "4096", "--graceful-shutdown-timeout", "300")
    try:
        seen = _wait_healthy(proc, url)
        assert set(seen) <= {503, 200}
        events, errors = [], []

        def stream():
            try:
                body = {"inputs": "Count from one to fifty:", "parameters": {"max_new_tokens": 20,
                                                                            "details": True}}
                with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120) as response:
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            events.append(json.loads(line[5:]))
            except Exception as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        thread = threading.Thread(target=stream)
        thread.start()
        while not events and thread.is_alive():
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # no new connections once draining
            httpx.post(url + "/generate", json={"inputs": "hi"}, timeout=5)
        thread.join(300)
        assert not errors
        assert events[-1]["generated_text"] is not None  # the in-flight stream finished
        assert events[-1]["details"]["generated_tokens"] == len(events) == 20
        # uvicorn re-raises the signal once drained, so the exit status is "terminated by SIGTERM"
        assert proc.wait(60) in (0, -signal.SIGTERM)
        logs = [line for line in proc.stdout.read().splitlines() if line.strip()]
        parsed = [json.loads(line) for line in logs if line.startswith("{")]
        assert parsed and len(parsed) >= len(logs) - 2  # JSON lines (a progress bar is not a tty here)
        assert {"timestamp", "level", "target", "message"} <= set(parsed[0])
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_unknown_model_is_a_one_line_error_before_serving():
    proc, _ = _start("--model-id", "no/such-model-anywhere")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "no/such-model-anywhere" in out and "Traceback" not in out
