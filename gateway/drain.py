"""Graceful shutdown of event streams and of requests still waiting.

On SIGTERM uvicorn stops accepting connections and gives the ones in flight
--graceful-shutdown-timeout seconds, then cancels them mid-response (the client
sees a truncated chunked body, or uvicorn's plain-text 500 if nothing was sent yet).
`StreamDrain` answers each request still running shortly before that deadline itself:
a Server-Sent-Events stream gets one error event in the route's dialect (OpenAI's then
`data: [DONE]`) and a clean end of its body; a request whose response has not begun
(e.g. one waiting on a grammar compile) gets a 503 JSON error in the route's dialect.
The route is then cancelled, which aborts its engine requests. A response already
under way that is not a stream runs on.

`Drain.begin()` is called when the signal arrives (serve.py hooks uvicorn's handler).
"""
from __future__ import annotations

import asyncio
import contextlib
import time

from .errors import ErrorKind, GatewayError, dialect_for_path

SHUTDOWN_MESSAGE = "the server is shutting down; the stream ended at the drain deadline"
UNANSWERED_MESSAGE = "the server is shutting down; the request did not finish by the drain deadline"


class Drain:
    """When the drain started and when streams must end; shared by the middleware and the server."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.deadline: float | None = None  # time.monotonic() at which open streams are ended
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Event | None = None

    def bind(self) -> asyncio.Event:
        """The event (of the running loop) set once draining begins. A server runs one loop;
        an app driven from several in turn (a test client) gets one event per loop."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._started = loop, asyncio.Event()
            if self.deadline is not None:
                self._started.set()
        return self._started

    def begin(self) -> None:
        """Start draining (safe from a signal handler or another thread; idempotent). Streams
        end a little before uvicorn's own deadline, so their final event is written in time."""
        if self.deadline is not None:
            return
        margin = min(2.0, self.grace_s / 4)
        self.deadline = time.monotonic() + max(0.0, self.grace_s - margin)
        if self._loop is not None and self._started is not None:
            self._loop.call_soon_threadsafe(self._started.set)

    @property
    def due(self) -> bool:
        """The drain deadline has passed."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    async def until_deadline(self) -> None:
        await self.bind().wait()
        while not self.due:  # a timer may fire a hair early
            await asyncio.sleep(max(0.0, self.deadline - time.monotonic()))


class StreamDrain:
    """ASGI middleware: runs each HTTP request as a task and, if it is an event stream
    still open at the drain deadline, ends it with an error event (see the module doc)."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        stream = _Stream(send, dialect_for_path(scope["path"]))
        route = asyncio.ensure_future(self.app(scope, receive, stream.send))
        deadline = asyncio.ensure_future(self.drain.until_deadline())
        try:
            await asyncio.wait({route, deadline}, return_when=asyncio.FIRST_COMPLETED)
            if not route.done() and self.drain.due and await stream.end_at_deadline(scope, receive):
                route.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await route
                return None
            deadline.cancel()
            await route  # a non-stream response under way runs on (uvicorn bounds it)
        finally:
            deadline.cancel()
            if not route.done():
                route.cancel()


class _Stream:
    """The response's `send`, serialized, so a final event never splits another write."""

    def __init__(self, send, dialect: str):
        self._send = send
        self.dialect = dialect
        self.started = False
        self.is_event_stream = False
        self._lock = asyncio.Lock()
        self._ended = False

    async def send(self, message) -> None:
        async with self._lock:
            if self._ended:
                return  # the drain already ended this response
            if message["type"] == "http.response.start":
                self.started = True
                headers = dict(message.get("headers") or ())
                self.is_event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            await self._send(message)

    async def end_at_deadline(self, scope, receive) -> bool:
        """End the response now if it is an event stream or has not begun (see the module
        doc); False for a response under way that is not a stream (it runs on)."""
        async with self._lock:
            if not self.started:
                self._ended = True
                error = GatewayError(ErrorKind.UNAVAILABLE, UNANSWERED_MESSAGE)
                await error.render(self.dialect)(scope, receive, self._send)
                return True
            if not self.is_event_stream:
                return False
            self._ended = True
            event = GatewayError(ErrorKind.UNAVAILABLE, SHUTDOWN_MESSAGE).stream_event(self.dialect)
            await self._send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
