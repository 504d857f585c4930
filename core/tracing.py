"""OpenTelemetry tracing, the part both processes share, and the engine's own spans.

Torch-free. Nothing here imports opentelemetry at module level: it is imported only when
tracing is on (`TracingConfig.enabled`), so a server without --otlp-endpoint loads none of it.

`make_provider` builds one process's tracer provider: its OTLP exporter (gRPC by default, as
TGI's; HTTP/protobuf when OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL says so, read with the flags
into `TracingConfig.protocol`) behind a batch span processor, which exports on a schedule
(OTEL_BSP_SCHEDULE_DELAY, 5 s by default) and flushes at shutdown. The exporter reads the
other OTEL_EXPORTER_OTLP_* variables (headers, timeout, certificates, compression) itself.

`EngineTracer` is the engine's side (core/engine/loop.py calls it): for each request that
arrived with a trace context (`Request.trace_context`, the gateway's request span), the spans
`queue` (added to the engine -> first scheduled, grammar wait included), `prefill` (first
scheduled -> first token) and `decode` (first token -> finished), children of that request
span; and per step that served a traced request, one `engine_step` span, a root of its own
(a step serves many requests) linked to the phase span of each request it served."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TracingConfig
    from .scheduling.request import Request, RequestOutput
    from .scheduling.output import SchedulerOutput

PROTOCOLS = ("grpc", "http/protobuf")


def protocol_from_environment(environ) -> str:
    """The OTLP protocol as the SDK's variables name it (traces' own first); "grpc" when unset."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if environ.get(name):
            return environ[name].strip().lower()
    return "grpc"


def make_provider(config: TracingConfig, process: str):
    """A TracerProvider for this process ("gateway" or "engine"), exporting to the collector.
    Not installed as the global provider: each process part asks its own."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": config.service_name, "switchyard.process": process,
                                "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
    return provider


def _exporter(config: TracingConfig):
    if config.protocol == "http/protobuf":
        from urllib.parse import urlsplit

        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

        endpoint = config.otlp_endpoint.rstrip("/")
        if urlsplit(endpoint).path in ("", "/"):  # a collector's base address: its traces path, as the SDK does
            endpoint += "/v1/traces"
        return HTTPExporter(endpoint=endpoint)
    if config.protocol != "grpc":
        raise ValueError(f"OTLP protocol {config.protocol!r} is not supported: use one of {', '.join(PROTOCOLS)}")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    # an http:// endpoint is a plaintext channel, https:// TLS (OTEL_EXPORTER_OTLP_INSECURE otherwise)
    return GrpcExporter(endpoint=config.otlp_endpoint)


def extract(carrier: dict[str, str] | None):
    """The OpenTelemetry context of a W3C carrier (traceparent, tracestate); an empty context for none."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier or {})


def inject(span) -> dict[str, str]:
    """The W3C carrier of `span`'s context, to hand to another process."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier


@dataclass
class _Traced:
    """One traced request in the engine: its parent context and the span of its phase now."""

    parent: object  # the gateway's request span, as a context
    phase: str  # "queue" | "prefill" | "decode"
    span: object
    num_prompt_tokens: int


class EngineTracer:
    """The engine's spans (see the module docstring). Its methods are called by the engine
    loop only when tracing is on; a request without a trace context is not followed."""

    def __init__(self, provider):
        from opentelemetry.trace import Link, Status, StatusCode

        self._provider = provider
        self._tracer = provider.get_tracer("switchyard.engine")
        self._link, self._status, self._error = Link, Status, StatusCode.ERROR
        self._requests: dict[str, _Traced] = {}

    @classmethod
    def start(cls, config: TracingConfig) -> EngineTracer:
        return cls(make_provider(config, "engine"))

    @property
    def num_traced(self) -> int:
        """Requests followed now (finished and aborted ones are forgotten)."""
        return len(self._requests)

    def add(self, request: Request, now_ns: int) -> None:
        if request.trace_context is None:
            return
        parent = extract(request.trace_context)
        span = self._tracer.start_span("queue", context=parent, start_time=now_ns,
                                       attributes={"request_id": request.request_id})
        if not span.is_recording():  # the caller's trace is not sampled: neither is its engine side
            return
        self._requests[request.request_id] = _Traced(parent, "queue", span, request.num_prompt_tokens)

    def step(self, scheduled: SchedulerOutput | None, outputs: list[RequestOutput], start_ns: int,
             end_ns: int) -> None:
        """One step, from `start_ns` to `end_ns` (time.time_ns()): phases that began or ended in
        it, and its `engine_step` span if it served a traced request."""
        served = []
        num_tokens = 0
        for item in scheduled.scheduled if scheduled is not None else ():
            num_tokens += item.num_new_tokens
            traced = self._requests.get(item.request_id)
            if traced is None:
                continue
            if traced.phase == "queue":
                self._next_phase(traced, "prefill", start_ns, {"prompt_tokens": traced.num_prompt_tokens,
                                                               "cached_tokens": item.num_computed_tokens})
            served.append(traced.span.get_span_context())
        if served:
            step = self._tracer.start_span(
                "engine_step", start_time=start_ns, links=[self._link(c) for c in served],
                attributes={"batch_size": len(scheduled.scheduled), "tokens": num_tokens,
                            "traced_requests": len(served)})
            step.end(end_time=end_ns)
        for out in outputs:
            traced = self._requests.get(out.request_id)
            if traced is None:
                continue
            if traced.phase == "prefill" and out.new_token_ids and not out.finished:
                self._next_phase(traced, "decode", end_ns, {})
            if out.finished:
                self._finish(out.request_id, end_ns, out)

    def end(self, request_id: str, now_ns: int, reason: str) -> None:
        """The request left the engine without finishing (aborted, its step failed)."""
        traced = self._requests.pop(request_id, None)
        if traced is not None:
            traced.span.set_attribute("finish_reason", reason)
            traced.span.end(end_time=now_ns)

    def shutdown(self) -> None:
        """Ends what is still open and flushes every span to the collector."""
        for request_id in list(self._requests):
            self.end(request_id, _now_ns(), "shutdown")
        self._provider.shutdown()

    def _next_phase(self, traced: _Traced, phase: str, at_ns: int, attributes: dict) -> None:
        traced.span.end(end_time=at_ns)
        traced.phase = phase
        traced.span = self._tracer.start_span(phase, context=traced.parent, start_time=at_ns, attributes=attributes)

    def _finish(self, request_id: str, at_ns: int, out: RequestOutput) -> None:
        traced = self._requests.pop(request_id)
        span = traced.span
        span.set_attribute("generated_tokens", out.num_output_tokens)
        if out.finish_reason is not None:
            span.set_attribute("finish_reason", out.finish_reason.value)
        if out.error is not None:
            span.set_status(self._status(self._error, str(out.error)))
        span.end(end_time=at_ns)


def _now_ns() -> int:
    import time

    return time.time_ns()
