"""What the chat and completions routes share: model names, response metadata,
usage, and the life of one request (admission, disconnects, SSE with errors)."""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from switchyard.core.client import RequestStream
from switchyard.core.request import FinishReason, RequestOutput

from ..errors import ErrorKind, GatewayError
from ..settings import ServerSettings
from ..service import until_disconnected
from ..streaming import sse_data, sse_response

logger = logging.getLogger("switchyard.gateway.openai")

# `model` values that mean "whatever is served" (huggingface_hub sends "dummy" to a
# URL; TGI's clients send "tgi"); any other name must be one that is served.
PLACEHOLDER_MODEL_NAMES = ("", "default", "tgi", "dummy")


def served_model_names(settings: ServerSettings) -> list[str]:
    return list(dict.fromkeys((settings.model_id, *settings.served_model_names)))


def resolve_model(name: str | None, settings: ServerSettings) -> str:
    """The name to report for a request's `model`; 404 for a model that is not served."""
    if name is None or name in PLACEHOLDER_MODEL_NAMES:
        return settings.model_id
    if name in served_model_names(settings):
        return name
    raise GatewayError(ErrorKind.NOT_FOUND, f"The model `{name}` does not exist. Served: "
                       f"{', '.join(served_model_names(settings))}", "model")


@dataclass(frozen=True)
class ResponseMeta:
    """The fields every response (and every chunk of a stream) carries."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, id_prefix: str, object_name: str, model: str, service) -> ResponseMeta:
        backend = getattr(service.client.info, "backend", "engine")
        return cls(f"{id_prefix}-{uuid.uuid4().hex}", object_name, int(time.time()), model,
                   f"switchyard-{service.settings.version}-{backend}")

    def body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices, **extra}


def openai_finish_reason(reason: FinishReason | None) -> str:
    """OpenAI's word for how a sequence ended (tool calls are relabelled by tool_output.py):
    `length` when cut off, `stop` for every natural end (EOS, a stop token or string, a
    complete grammar) and for an abort."""
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens` are prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class CachedTokens:
    """Prompt tokens served from the cache, counted once per prompt: by the first
    sequence of each (siblings reuse its blocks and would count them again)."""

    def __init__(self, num_sequences: int):
        self._num_sequences = num_sequences
        self._by_prompt: dict[int, int] = {}

    def record(self, index: int, num_cached_tokens: int) -> None:
        if index % self._num_sequences == 0:
            self._by_prompt[index // self._num_sequences] = num_cached_tokens

    @property
    def total(self) -> int:
        return sum(self._by_prompt.values())


async def admitted(service, prepare: Callable[[], Awaitable]):
    """Take a concurrency slot (429 past the limit), then run `prepare` (validation,
    tokenization, submission); the slot is released if that fails."""
    admission = service.admit()
    try:
        return admission, await prepare()
    except BaseException as exc:
        admission.release(exc)
        raise


async def collect_and_release(service, admission, streams: list[RequestStream], http_request: Request):
    """A non-streamed answer's completions; the admission slot is released either way."""
    try:
        completions = await collect_unless_disconnected(service, streams, http_request)
    except BaseException as exc:
        admission.release(exc)
        raise
    admission.release()
    return completions


async def collect_unless_disconnected(service, streams: list[RequestStream], http_request: Request):
    """Completions of all streams; if the client goes away first, the streams are
    aborted (their KV blocks freed) and INCOMPLETE is raised."""
    return await until_disconnected(service.collect_all(streams), http_request, streams,
                                    GatewayError(ErrorKind.INCOMPLETE, "the client disconnected"))


class ChunkBuilder:
    """Turns engine outputs into the payloads of a stream's events."""

    def on_output(self, index: int, out: RequestOutput) -> list[dict]:
        raise NotImplementedError

    def tail(self) -> list[dict]:
        """Payloads after every sequence finished (the usage chunk)."""
        return []


def openai_stream(service, admission, streams: list[RequestStream], chunks: ChunkBuilder, request_id: str):
    """The SSE response of a stream: chunks, then `[DONE]`; an error mid-stream is sent
    as one `{"error": {...}}` event. A disconnect aborts the streams and frees the slot."""

    def close() -> None:
        for stream in streams:
            stream.abort()
        admission.release(GatewayError(ErrorKind.INCOMPLETE, "the client disconnected"))

    return sse_response(_events(service, admission, streams, chunks), {"x-request-id": request_id}, close)


async def _events(service, admission, streams, chunks: ChunkBuilder) -> AsyncIterator[str]:
    outputs = service.merged(streams)
    try:
        async for index, out in outputs:
            for payload in chunks.on_output(index, out):
                yield sse_data(payload)
        for payload in chunks.tail():
            yield sse_data(payload)
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream, then logged
        error = exc if isinstance(exc, GatewayError) else GatewayError(
            ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}")
        if not isinstance(exc, GatewayError):
            logger.exception("stream failed")
        admission.release(error)
        yield sse_data({"error": {**error.openai_body()["error"], "http_status_code": error.openai_status}})
    else:
        admission.release()
    finally:
        await outputs.aclose()
    yield sse_data("[DONE]")
