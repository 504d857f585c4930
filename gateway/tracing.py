"""OpenTelemetry tracing of HTTP requests (TGI's --otlp-endpoint, --otlp-service-name).

Off by default, and then nothing of opentelemetry is imported and no middleware installed:
the pipeline's hooks find no `current()` trace and do nothing.

On, `TracingMiddleware` (pure ASGI, so it spans a streamed body to its last byte) opens one
server span per inference request (POST), continuing an incoming W3C `traceparent`; the
request's `RequestTrace` is the context variable `current()` for the handler, its stream and
the threads it tokenizes on. Its children, all direct:

    validation       parse, chat template, tokenization, limits, submit (gateway/pipeline.py)
    grammar_compile  the engine compiling the request's grammar (gateway/structured.py)
    queue, prefill, decode   from the engine process, under the same trace (core/tracing.py):
                     the request span's context rides on each `Request.trace_context`

Attributes as TGI's router names them: `parameters` (the sampling parameters, never the
prompt), `seed`, `validation_time`, `queue_time`, `inference_time`, `time_per_token`,
`total_time` (seconds), with `prompt_tokens` and `generated_tokens`."""
from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING

from switchyard.core.config import TracingConfig
from switchyard.core.params import ValidationError
from switchyard.core.tracing import PROTOCOLS, protocol_from_environment

if TYPE_CHECKING:
    from switchyard.core.scheduling.request import Request, RequestOutput

DEFAULT_SERVICE_NAME = "switchyard"
# span names of the inference routes, TGI's where it has the route; any other POST: its path
_ROUTE_SPANS = {"/generate": "generate", "/generate_stream": "generate_stream", "/": "compat_generate",
                "/v1/chat/completions": "chat_completions", "/v1/completions": "completions",
                "/v1/responses": "responses", "/tokenize": "tokenize"}

_current: ContextVar[RequestTrace | None] = ContextVar("switchyard_request_trace", default=None)


def current() -> RequestTrace | None:
    """The trace of the request being served here, or None (tracing off, or not a traced route)."""
    return _current.get()


def child_span(name: str, **attributes):
    """A child span of the current request's around a block; nothing when it is not traced."""
    trace = _current.get()
    return trace.child(name, **attributes) if trace is not None else contextlib.nullcontext()


def add_tracing_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument("--otlp-endpoint", default=environ.get("OTLP_ENDPOINT") or None,
                        help="send OpenTelemetry traces to this OTLP collector, e.g. http://127.0.0.1:4317 "
                        "(gRPC; HTTP/protobuf when OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf); default: no "
                        "tracing [env: OTLP_ENDPOINT]")
    parser.add_argument("--otlp-service-name", default=environ.get("OTLP_SERVICE_NAME") or DEFAULT_SERVICE_NAME,
                        help=f"service.name of the exported spans (default: {DEFAULT_SERVICE_NAME}) "
                        "[env: OTLP_SERVICE_NAME]")
    parser.set_defaults(otlp_protocol=protocol_from_environment(environ))


def tracing_config(args: argparse.Namespace) -> TracingConfig:
    """The flags as the frozen configuration both processes get; an unknown protocol is a user error."""
    if args.otlp_endpoint is not None and args.otlp_protocol not in PROTOCOLS:
        raise ValidationError(f"OTEL_EXPORTER_OTLP_PROTOCOL={args.otlp_protocol!r} is not supported with "
                              f"--otlp-endpoint: use one of {', '.join(PROTOCOLS)}")
    return TracingConfig(otlp_endpoint=args.otlp_endpoint, service_name=args.otlp_service_name,
                         protocol=args.otlp_protocol)


class GatewayTracing:
    """The server process's tracer provider and tracer; `shutdown` flushes what is left."""

    def __init__(self, provider):
        from opentelemetry import trace

        self.provider = provider
        self.tracer = provider.get_tracer("switchyard.gateway")
        self._trace = trace

    @classmethod
    def start(cls, config: TracingConfig) -> GatewayTracing:
        from switchyard.core.tracing import make_provider

        return cls(make_provider(config, "gateway"))

    def shutdown(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    """One request's span; its children are made here, each a direct child of it."""

    def __init__(self, tracing: GatewayTracing, span):
        self._tracing = tracing
        self.span = span
        self._context = tracing._trace.set_span_in_context(span)
        self._generated_tokens = 0

    @contextlib.contextmanager
    def child(self, name: str, **attributes) -> Iterator[object]:
        """A child span around the block; an exception in it marks the span as an error."""
        with self._tracing.tracer.start_as_current_span(name, context=self._context, attributes=attributes,
                                                        record_exception=True, set_status_on_exception=True) as span:
            yield span

    def on_submit(self, requests: list[Request]) -> None:
        """The engine's spans continue this one: each request carries its context."""
        from switchyard.core.tracing import inject

        carrier = inject(self.span)
        params = requests[0].sampling_params
        self.span.set_attribute("parameters", _parameters(params))
        if params.seed is not None:
            self.span.set_attribute("seed", params.seed)
        self.span.set_attribute("prompt_tokens", requests[0].num_prompt_tokens)
        self.span.set_attribute("sequences", len(requests))
        for request in requests:
            request.trace_context = carrier

    def on_finished(self, last: RequestOutput, timings) -> None:
        """TGI's timing attributes (of the last sequence to finish; `timings`: service.Timings,
        not imported here, which service.py imports) and the tokens generated."""
        self._generated_tokens += last.num_output_tokens
        span = self.span
        span.set_attribute("generated_tokens", self._generated_tokens)
        span.set_attribute("validation_time", timings.validation)
        span.set_attribute("queue_time", timings.queue)
        span.set_attribute("inference_time", timings.inference)
        span.set_attribute("total_time", timings.total)
        if last.num_output_tokens:
            span.set_attribute("time_per_token", timings.inference / last.num_output_tokens)
        if last.finish_reason is not None:
            span.set_attribute("finish_reason", last.finish_reason.value)


def _parameters(params) -> str:
    """The sampling parameters as one string, like TGI's `?req.parameters` (no prompt text in them)."""
    text = repr(params)
    return text if len(text) <= 4096 else text[:4093] + "..."


class TracingMiddleware:
    """Pure ASGI: one span per POST from its first byte to its response's last, continuing an
    incoming `traceparent`; a 5xx, or an exception, marks it as an error."""

    def __init__(self, app, tracing: GatewayTracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        from switchyard.core.tracing import extract

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"traceparent", b"tracestate")}
        path = scope["path"]
        span = self.tracing.tracer.start_span(
            _ROUTE_SPANS.get(path, path), context=extract(headers), kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": path}, start_time=time.time_ns())
        token = _current.set(RequestTrace(self.tracing, span))
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        else:
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        finally:
            span.end()
            _current.reset(token)
