"""OpenTelemetry tracing (gateway/tracing.py, core/tracing.py) against a real OTLP receiver
(opentelemetry-proto's gRPC TraceService, and HTTP/protobuf): the span tree of a streamed
request through the real gateway and engine loop, on a random-weight toy model; the flags;
and that tracing off imports nothing of opentelemetry."""
from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys

import httpx
import pytest
from otlp_receiver import GrpcReceiver, HttpReceiver
from reliability_servers import serve_draining, tiny_engine

from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.config import GrammarConfig, TracingConfig
from switchyard.core.params import ValidationError
from switchyard.gateway.cli import build_parser
from switchyard.gateway.serve import engine_config, server_settings

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
PROMPT = "zebra crossing at dawn"


@pytest.fixture(autouse=True)
def _fast_export(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the batch processor exports every 0.1 s


@contextlib.contextmanager
def traced_tiny(receiver, protocol: str = "grpc"):
    """The toy model behind a real uvicorn server, both sides exporting to `receiver`."""
    tracing = TracingConfig(otlp_endpoint=receiver.endpoint, service_name="switchyard-test", protocol=protocol)
    client = InProcessEngineClient(lambda: tiny_engine(GrammarConfig(use_processes=False)), tracing=tracing)
    client.start()
    asyncio.run(client.wait_ready(timeout=120))
    server, thread, url = serve_draining(client, tracing=tracing)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        asyncio.run(client.shutdown())  # the engine loop flushes its spans as it stops
        server.config.app.state.tracing.shutdown()
        receiver.stop()


def _stream(url: str, parameters: dict, headers: dict | None = None) -> list[dict]:
    body = {"inputs": PROMPT, "parameters": parameters}
    events = []
    with httpx.stream("POST", url + "/generate_stream", json=body, headers=headers or {}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


def _by_name(spans, trace_id):
    named = {}
    for span in spans:
        if span.trace_id == trace_id:
            assert span.name not in named, f"two {span.name} spans"
            named[span.name] = span
    return named


def _complete(spans) -> bool:
    names = {s.name for s in spans if s.trace_id == TRACE_ID}
    return {"generate_stream", "validation", "grammar_compile", "queue", "prefill", "decode"} <= names and any(
        s.name == "engine_step" for s in spans)


def test_a_streamed_request_is_one_trace_continuing_its_traceparent():
    receiver = GrpcReceiver()
    with traced_tiny(receiver) as url:
        events = _stream(url, {"max_new_tokens": 6, "seed": 7, "do_sample": True, "details": True,
                               "grammar": {"type": "regex", "value": "[ab]{6}"}}, {"traceparent": TRACEPARENT})
        assert events[-1]["details"]["generated_tokens"] == 6
        spans = receiver.wait_for(_complete)
    named = _by_name(spans, TRACE_ID)
    request = named["generate_stream"]
    assert request.parent_span_id == PARENT_ID  # the caller's span continued
    for child in ("validation", "grammar_compile", "queue", "prefill", "decode"):
        assert named[child].parent_span_id == request.span_id, child
        assert request.start_ns <= named[child].start_ns <= named[child].end_ns <= request.end_ns, child
    # the phases follow one another
    assert named["queue"].end_ns == named["prefill"].start_ns
    assert named["prefill"].end_ns == named["decode"].start_ns
    assert named["validation"].start_ns <= named["grammar_compile"].start_ns
    # each process exports its own spans, under the same service
    assert request.resource["switchyard.process"] == "gateway"
    assert named["validation"].resource["switchyard.process"] == "gateway"
    for phase in ("queue", "prefill", "decode"):
        assert named[phase].resource["switchyard.process"] == "engine"
    assert {s.resource["service.name"] for s in named.values()} == {"switchyard-test"}
    # TGI's attributes; the prompt text is nowhere
    attributes = request.attributes
    assert attributes["http.response.status_code"] == 200
    assert "temperature" in attributes["parameters"] and "seed=7" in attributes["parameters"]
    assert attributes["seed"] == 7
    assert attributes["prompt_tokens"] == len(PROMPT.encode())  # the toy tokenizer is byte-level
    assert attributes["generated_tokens"] == 6
    for timing in ("validation_time", "queue_time", "inference_time", "time_per_token", "total_time"):
        assert 0 <= attributes[timing] <= attributes["total_time"], timing
    assert named["prefill"].attributes["prompt_tokens"] == len(PROMPT.encode())
    assert named["decode"].attributes["generated_tokens"] == 6
    assert named["grammar_compile"].attributes["kind"] == "regex"
    assert all(PROMPT not in str(s.attributes) for s in spans)
    # engine steps: roots of their own traces, linked to the phase span of each request they served
    steps = [s for s in spans if s.name == "engine_step"]
    assert all(s.trace_id != TRACE_ID and s.parent_span_id == "" for s in steps)
    linked = {link for s in steps for link in s.links}
    assert (TRACE_ID, named["prefill"].span_id) in linked and (TRACE_ID, named["decode"].span_id) in linked
    assert len(steps) >= 6  # one step per token at least
    assert all(s.attributes["batch_size"] >= 1 and s.attributes["traced_requests"] == 1 for s in steps)


def test_without_traceparent_a_new_trace_starts_and_http_protobuf_is_spoken():
    receiver = HttpReceiver()
    with traced_tiny(receiver, protocol="http/protobuf") as url:
        _stream(url, {"max_new_tokens": 3})
        spans = receiver.wait_for(lambda s: {"generate_stream", "decode"} <= {x.name for x in s})
    request = next(s for s in spans if s.name == "generate_stream")
    assert request.parent_span_id == "" and request.trace_id != TRACE_ID
    assert {"validation", "queue", "prefill", "decode"} <= set(_by_name(spans, request.trace_id))
    assert "grammar_compile" not in _by_name(spans, request.trace_id)  # no grammar, no compile


def test_a_refused_request_is_an_error_free_4xx_span_and_get_routes_are_not_traced():
    receiver = GrpcReceiver()
    with traced_tiny(receiver) as url:
        assert httpx.get(url + "/health").status_code == 200
        answer = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 0}},
                            headers={"traceparent": TRACEPARENT})
        assert answer.status_code == 422
        spans = receiver.wait_for(lambda s: any(x.name == "generate" for x in s))
    named = _by_name(spans, TRACE_ID)
    assert named["generate"].attributes["http.response.status_code"] == 422
    assert named["generate"].status_code == 0  # unset: the client's error, not the server's
    assert named["validation"].status_code == 2  # error: the validation failed there
    assert "queue" not in named  # nothing reached the engine
    assert not any(s.attributes.get("url.path") == "/health" for s in spans)


def test_an_aborted_request_ends_its_engine_spans():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from switchyard.core.params import SamplingParams
    from switchyard.core.scheduling.request import Request
    from switchyard.core.tracing import EngineTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = EngineTracer(provider)
    request = Request("r1", [1, 2, 3], SamplingParams(max_tokens=4))
    request.trace_context = {"traceparent": TRACEPARENT}
    tracer.add(request, 1_000)
    tracer.add(Request("untraced", [1], SamplingParams(max_tokens=4)), 1_000)
    assert tracer.num_traced == 1
    tracer.end("r1", 2_000, "abort")
    assert tracer.num_traced == 0
    (queue,) = exporter.get_finished_spans()
    assert queue.name == "queue" and queue.attributes["finish_reason"] == "abort"
    assert format(queue.context.trace_id, "032x") == TRACE_ID and queue.end_time == 2_000
    tracer.shutdown()


def _parse(argv=(), environ=None):
    return build_parser(environ or {}).parse_args(["serve", *argv])


def test_flags_and_their_environment_variables():
    off = _parse()
    assert engine_config(off).tracing == TracingConfig() == server_settings(off).tracing
    assert not TracingConfig().enabled and TracingConfig().service_name == "switchyard"
    env = {"OTLP_ENDPOINT": "http://collector:4317", "OTLP_SERVICE_NAME": "llm",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    on = _parse(environ=env)
    assert engine_config(on).tracing == TracingConfig("http://collector:4317", "llm", "http/protobuf")
    assert server_settings(on).tracing == engine_config(on).tracing
    flags = _parse(["--otlp-endpoint", "http://other:4317", "--otlp-service-name", "x"],
                   {**env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
    assert engine_config(flags).tracing == TracingConfig("http://other:4317", "x", "grpc")
    with pytest.raises(ValidationError, match="http/json"):
        engine_config(_parse(["--otlp-endpoint", "http://c:4318"], {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}))


def test_tracing_off_imports_no_opentelemetry():
    # FastAPI imports opentelemetry's API itself when it is installed (fastapi.telemetry): that is
    # the baseline; the SDK, the exporters and anything more of the API are ours to leave alone
    code = """
import sys
import fastapi
baseline = {m for m in sys.modules if m.startswith("opentelemetry")}
from switchyard.core.engine.client import InProcessEngineClient
from switchyard.gateway.app import create_app
from switchyard.gateway.settings import ServerSettings
import switchyard.core.engine.loop, switchyard.gateway.tracing
app = create_app(ServerSettings(model_id="m"), InProcessEngineClient(lambda: None))
assert app.state.tracing is None
loaded = [m for m in sys.modules if m.startswith("opentelemetry") and m not in baseline]
assert not loaded, loaded
assert not [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter", "grpc"))]
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
