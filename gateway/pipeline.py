"""The life of one generation request, written once for every dialect.

A dialect parses its body into a plan and renders engine outputs into its wire
format; between the two, this pipeline does the rest:

    admit (a --max-concurrent-requests slot, 429 past it)
    -> prepare: the dialect's parse, chat rendering and tokenization off the event
       loop (`off_loop`), length limits, grammar pre-check, submit
    -> answer: collect every sequence (a disconnect aborts them), or stream events
       from a `StreamRenderer` (a disconnect or an error ends the stream cleanly)

The admission slot is released exactly once, with the outcome (metrics). A generation pipeline
on a model served for embeddings is refused first (400), before any template or tokenizer runs;
embeddings (gateway/embeddings.py) take the pipeline with `embeddings=True`."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

from fastapi import Request

from switchyard.core.engine.client import RequestStream
from switchyard.core.scheduling.request import RequestOutput

from .errors import ErrorKind, GatewayError
from .service import Admission, GenerationService, until_disconnected
from .streaming import sse_response
from .tracing import child_span

logger = logging.getLogger("switchyard.gateway.pipeline")


async def off_loop(function: Callable, *args, **kwargs):
    """Run CPU work of a request (chat template, tokenizer) on a worker thread, so one
    long prompt does not stall every other stream on the event loop."""
    return await asyncio.to_thread(partial(function, *args, **kwargs))


def _disconnected() -> GatewayError:
    return GatewayError(ErrorKind.INCOMPLETE, "the client went away before the answer was complete")


class StreamRenderer:
    """A dialect's stream: engine outputs -> SSE-framed events."""

    def head(self) -> list[str]:
        """Events sent at once, before the first output (the Responses API's `response.created`)."""
        return []

    def on_output(self, index: int, out: RequestOutput) -> list[str]:
        raise NotImplementedError

    def tail(self) -> list[str]:
        """Events after every sequence finished (a usage chunk, a completed event)."""
        return []

    def on_error(self, error: GatewayError) -> list[str]:
        """Events that report an error once the stream has started."""
        raise NotImplementedError

    def end(self) -> list[str]:
        """Events that close the stream whatever happened (OpenAI chat's `[DONE]`)."""
        return []


class Pipeline:
    def __init__(self, service: GenerationService, embeddings: bool = False):
        self.service = service
        self.embeddings = embeddings  # pooling requests (gateway/embeddings.py checks the model); else generation

    async def start(self, prepare: Callable[[], Awaitable]):
        """Take a concurrency slot (429 past the limit), then run `prepare` (parse,
        tokenize, check, submit); the slot is released if that fails. Returns
        (admission, what prepare returned)."""
        admission = self.service.admit()
        if not self.embeddings:
            try:
                self.service.require_generation()
            except GatewayError as exc:
                admission.release(exc)
                raise
        try:
            with child_span("validation"):
                prepared = await prepare()
        except BaseException as exc:
            admission.release(exc)
            raise
        self.service.metrics.request_validation_duration.observe(time.monotonic() - admission.received_at)
        return admission, prepared

    async def collect(self, admission: Admission, streams: list[RequestStream], http_request: Request,
                      work: Awaitable | None = None):
        """A whole answer: `work` (default: every stream's `Completion`); a client gone
        first aborts the streams (their KV blocks are freed) as INCOMPLETE. The slot is
        released either way."""
        try:
            result = await until_disconnected(
                work if work is not None else self.service.collect_all(streams), http_request, streams,
                _disconnected())
        except BaseException as exc:
            admission.release(_disconnected() if isinstance(exc, asyncio.CancelledError) else exc)
            raise
        admission.release()
        return result

    def stream(self, admission: Admission, streams: list[RequestStream], renderer: StreamRenderer,
               headers: dict[str, str]):
        """The SSE response; an error mid-stream is rendered by the dialect, a disconnect
        aborts the streams and frees the slot."""

        def close() -> None:
            for stream in streams:
                stream.abort()
            admission.release(_disconnected())

        return sse_response(self._events(admission, streams, renderer), headers, close)

    async def _events(self, admission: Admission, streams, renderer: StreamRenderer) -> AsyncIterator[str]:
        outputs = self.service.merged(streams)
        try:
            for event in renderer.head():
                yield event
            async for index, out in outputs:
                for event in renderer.on_output(index, out):
                    yield event
            for event in renderer.tail():
                yield event
        except Exception as exc:  # noqa: BLE001 - reported to the client in the stream, then logged
            error = exc if isinstance(exc, GatewayError) else GatewayError(
                ErrorKind.INTERNAL, "internal error")  # the class and traceback go to the log only
            if not isinstance(exc, GatewayError):
                logger.exception("stream failed")
            admission.release(error)
            for event in renderer.on_error(error):
                yield event
        else:
            admission.release()
        finally:
            await outputs.aclose()
        for event in renderer.end():
            yield event
