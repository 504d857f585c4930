"""A small OpenAI-compatible streaming server for the bench tests (stdlib only, a thread per
request): fixed chunk timing, a chosen number of tokens per chunk, usage sent or not, and a
500 for every n-th chat request. It records what it was sent and when."""
from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class StubConfig:
    model: str = "stub-model"
    first_delay_s: float = 0.05  # before the first text chunk
    gap_s: float = 0.02  # between text chunks
    tokens_per_chunk: int = 1
    send_usage: bool = True  # honours stream_options.include_usage
    fail_every: int = 0  # every n-th chat request (1-based) answers 500; 0: never
    loading_for: int = 0  # the first n chat requests answer 503, as a server still loading


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default 5 resets connections when many clients connect at once


@dataclass(frozen=True)
class Received:
    body: dict
    start: float
    end: float
    status: int


class StubServer:
    def __init__(self, config: StubConfig = StubConfig()):
        self.config = config
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._count = 0
        self._httpd = _Server(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "StubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def next_status(self) -> int:
        """The status of the next chat request: 503 while loading, 500 every n-th, else 200."""
        with self._lock:
            self._count += 1
            if self._count <= self.config.loading_for:
                return 503
            failing = bool(self.config.fail_every) and self._count % self.config.fail_every == 0
            return 500 if failing else 200

    def record(self, received: Received) -> None:
        with self._lock:
            self.received.append(received)


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _handler(stub: StubServer):
    config = stub.config

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _json(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": config.model, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self):
            start = time.perf_counter()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status = stub.next_status() if self.path == "/v1/chat/completions" else 404
            if status != 200:  # recorded before the answer: a client that stops at it must find it counted
                stub.record(Received(body, start, time.perf_counter(), status))
                self._json(status, {"error": {"message": f"stub {status}", "type": "server_error"}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self._stream(body)
            stub.record(Received(body, start, time.perf_counter(), 200))

        def _stream(self, body: dict) -> None:
            tokens = body["max_tokens"]
            base = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": config.model}
            self.wfile.write(_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
            time.sleep(config.first_delay_s)
            for index in range(math.ceil(tokens / config.tokens_per_chunk)):
                if index:
                    time.sleep(config.gap_s)
                text = "tok " * config.tokens_per_chunk
                self.wfile.write(_event({**base, "choices": [{"index": 0, "delta": {"content": text}}]}))
            self.wfile.write(_event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
            if config.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": tokens + 7}
                self.wfile.write(_event({**base, "choices": [], "usage": usage}))
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler
