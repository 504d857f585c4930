"""JSON encoding and Server-Sent Events framing shared by both dialects."""
from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

# Clip of non-finite log-probabilities, as vLLM does: JSON has no -inf.
MIN_LOGPROB = -9999.0


def finite(value: float) -> float:
    """A float that JSON can carry: -inf/nan -> MIN_LOGPROB, +inf -> a large finite number."""
    if math.isnan(value) or value == -math.inf:
        return MIN_LOGPROB
    if value == math.inf:
        return 1e30
    return value


def _sanitize(obj):
    if isinstance(obj, float):
        return finite(obj) if not math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {k: _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v) for v in obj]
    return obj


def json_dumps(obj) -> str:
    """Compact JSON that never contains NaN or Infinity."""
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_sanitize(obj), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sse_data(payload: dict | str, dialect: str = "openai") -> str:
    """One SSE event. OpenAI-style `data: {...}`; TGI writes `data:{...}` (axum), which
    its clients parse either way."""
    data = payload if isinstance(payload, str) else json_dumps(payload)
    return f"data: {data}\n\n" if dialect == "openai" else f"data:{data}\n\n"


def sse_event(name: str, payload: dict) -> str:
    """One named SSE event (`event: <name>` then `data: {...}`), as the Responses API sends."""
    return f"event: {name}\ndata: {json_dumps(payload)}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(events: AsyncIterator[str], headers: dict[str, str] | None = None,
                 on_close: Callable[[], None] | None = None) -> StreamingResponse:
    """Starlette cancels `events` when the client disconnects; the generator's
    `finally` must abort its engine requests. `on_close` runs however the response
    ends, even if the generator never started (client gone before the first byte)."""
    return _ClosingStreamingResponse(events, media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **(headers or {})}, on_close=on_close)


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the event generator (running its `finally`) and calls `on_close` when the
    response ends: finished, cancelled by a disconnect, or failed to send."""

    def __init__(self, *args, on_close: Callable[[], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()
