"""Graceful shutdown of event streams.

On SIGTERM uvicorn stops accepting connections and gives the ones in flight
--graceful-shutdown-timeout seconds, then cancels them mid-response (the client
sees a truncated chunked body). `StreamDrain` ends each Server-Sent-Events stream
still running shortly before that deadline itself: one error event in the route's
dialect (OpenAI's then `data: [DONE]`), then a clean end of the body; the route is
then cancelled, which aborts its engine requests. Other responses are untouched.

`Drain.begin()` is called when the signal arrives (serve.py hooks uvicorn's handler).
"""
from __future__ import annotations

import asyncio
import contextlib
import time

from .errors import ErrorKind, GatewayError, dialect_for_path

SHUTDOWN_MESSAGE = "the server is shutting down; the stream ended at the drain deadline"


class Drain:
    """When the drain started and when streams must end; shared by the middleware and the server."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.deadline: float | None = None  # time.monotonic() at which open streams are ended
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Event | None = None

    def bind(self) -> asyncio.Event:
        """The event (of the running loop) set once draining begins."""
        if self._started is None:
            self._loop = asyncio.get_running_loop()
            self._started = asyncio.Event()
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

    async def until_deadline(self) -> None:
        await self.bind().wait()
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
            if not route.done() and stream.is_event_stream:
                await stream.end_with_shutdown_error()
                route.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await route
                return None
            deadline.cancel()
            await route  # a non-stream response runs on (uvicorn bounds it)
        finally:
            deadline.cancel()
            if not route.done():
                route.cancel()


class _Stream:
    """The response's `send`, serialized, so a final event never splits another write."""

    def __init__(self, send, dialect: str):
        self._send = send
        self.dialect = dialect
        self.is_event_stream = False
        self._lock = asyncio.Lock()
        self._ended = False

    async def send(self, message) -> None:
        async with self._lock:
            if self._ended:
                return  # the drain already ended this response
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or ())
                self.is_event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            await self._send(message)

    async def end_with_shutdown_error(self) -> None:
        async with self._lock:
            self._ended = True
            event = GatewayError(ErrorKind.UNAVAILABLE, SHUTDOWN_MESSAGE).stream_event(self.dialect)
            await self._send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
