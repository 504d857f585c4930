"""A real OTLP trace receiver for the tracing tests (tests/ has no packages: imported by
name): opentelemetry-proto's gRPC `TraceService` on a free port, and the same collector
over HTTP/protobuf (POST /v1/traces). Both keep every span they receive, with its
resource's attributes, in `spans`."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    resource: dict
    status_code: int


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _collect(request, into: list, lock: threading.Lock) -> None:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                    span.start_time_unix_nano, span.end_time_unix_nano,
                    {kv.key: _value(kv.value) for kv in span.attributes},
                    tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links), resource,
                    span.status.code))
    with lock:
        into.extend(spans)


class _Receiver:
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def wait_for(self, predicate, timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans received once `predicate(spans)` holds; fails after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            assert time.monotonic() < deadline, f"spans never arrived; got {[s.name for s in spans]}"
            time.sleep(0.05)


class GrpcReceiver(_Receiver):
    def __init__(self):
        super().__init__()
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the proto's name
                _collect(request, receiver.spans, receiver._lock)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)


class HttpReceiver(_Receiver):
    def __init__(self):
        super().__init__()
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                _collect(request, receiver.spans, receiver._lock)
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
