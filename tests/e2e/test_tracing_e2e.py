"""`switchyard serve --otlp-endpoint` as a user runs it, the default model in its engine
process, against a real OTLP gRPC receiver (opentelemetry-proto's TraceService): one streamed
chat request with a `traceparent` arrives as one trace, the gateway's spans and the engine
process's under it, flushed when the server stops."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gateway"))  # tests/ has no packages
from otlp_receiver import GrpcReceiver  # noqa: E402
from switchyard.core.testing.serving import free_port

pytestmark = pytest.mark.slow

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server never became healthy")


def test_a_streamed_chat_request_is_one_trace_across_both_processes():
    receiver = GrpcReceiver()
    port = free_port()
    # nothing is exported on the schedule before the server stops: what arrives was flushed at shutdown
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--port", str(port),
                             "--enforce-eager", "--max-batch-total-tokens", "4096",
                             "--otlp-endpoint", receiver.endpoint, "--otlp-service-name", "switchyard-e2e"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        body = {"model": "default", "stream": True, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "Name a colour."}],
                "response_format": {"type": "json_object"}}
        chunks = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=180,
                          headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunks.append(json.loads(line[5:]))
        assert chunks
        assert receiver.spans == []  # the batch processor holds them (schedule: 10 minutes)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) in (0, -signal.SIGTERM)
        spans = receiver.wait_for(lambda s: {"chat_completions", "decode"} <= {x.name for x in s}, timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        receiver.stop()
    ours = {s.name: s for s in spans if s.trace_id == TRACE_ID}
    assert {"chat_completions", "validation", "grammar_compile", "queue", "prefill", "decode"} <= set(ours)
    request = ours["chat_completions"]
    assert request.parent_span_id == PARENT_ID
    assert all(ours[n].parent_span_id == request.span_id for n in set(ours) - {"chat_completions"})
    assert request.attributes["prompt_tokens"] > 0 and request.attributes["generated_tokens"] >= 1
    # the engine's spans came from the engine process (its own exporter), the rest from the server's
    engine_pids = {s.resource["process.pid"] for s in spans if s.resource["switchyard.process"] == "engine"}
    server_pids = {s.resource["process.pid"] for s in spans if s.resource["switchyard.process"] == "gateway"}
    assert len(engine_pids) == len(server_pids) == 1 and engine_pids != server_pids
    assert {ours[n].resource["switchyard.process"] for n in ("queue", "prefill", "decode")} == {"engine"}
    assert {s.resource["service.name"] for s in spans} == {"switchyard-e2e"}
    steps = [s for s in spans if s.name == "engine_step"]
    assert steps and all(s.trace_id != TRACE_ID for s in steps)
    assert (TRACE_ID, ours["decode"].span_id) in {link for s in steps for link in s.links}
