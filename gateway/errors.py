"""One error taxonomy, rendered in the OpenAI shape or the TGI shape.

OpenAI routes (`/v1/...`): `{"error": {"message", "type", "param", "code"}}`.
TGI routes: `{"error": str, "error_type": str}`.
A dialect added beside them (gateway/anthropic/) registers its paths and its two
renderings with `register_dialect`; every error on its paths is then rendered its way.
"""
from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from .streaming import json_dumps, sse_data

logger = logging.getLogger("switchyard.gateway")


@dataclass(frozen=True)
class _Kind:
    openai_status: int
    openai_type: str
    tgi_status: int
    tgi_type: str


class ErrorKind(enum.Enum):
    VALIDATION = _Kind(400, "invalid_request_error", 422, "validation")
    TEMPLATE = _Kind(400, "invalid_request_error", 422, "template_error")
    TOOL = _Kind(400, "invalid_request_error", 422, "tool_error")
    AUTHENTICATION = _Kind(401, "authentication_error", 401, "authentication")
    NOT_FOUND = _Kind(404, "not_found_error", 404, "not_found")
    MODEL_NOT_FOUND = _Kind(404, "invalid_request_error", 404, "model_not_found")  # a `model` not served
    METHOD_NOT_ALLOWED = _Kind(405, "invalid_request_error", 405, "method_not_allowed")
    PAYLOAD_TOO_LARGE = _Kind(413, "invalid_request_error", 413, "payload_too_large")
    OVERLOADED = _Kind(429, "rate_limit_error", 429, "overloaded")
    GENERATION = _Kind(500, "server_error", 424, "generation")
    INCOMPLETE = _Kind(500, "server_error", 500, "incomplete_generation")
    UNAVAILABLE = _Kind(503, "service_unavailable", 503, "unavailable")
    INTERNAL = _Kind(500, "server_error", 500, "internal")


RETRY_AFTER_SECONDS = 1
_RETRIED_KINDS = (ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE)  # answered with a Retry-After header


class GatewayError(Exception):
    """An error value with a kind; routes raise it, the app renders it per dialect."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self._headers = headers  # e.g. `allow` of a 405

    @property
    def headers(self) -> dict[str, str] | None:
        if self.kind in _RETRIED_KINDS:  # busy, loading, a compile worker starting, shutting down
            return {"retry-after": str(RETRY_AFTER_SECONDS), **(self._headers or {})}
        return self._headers

    # -- OpenAI dialect ---------------------------------------------------------------
    @property
    def openai_status(self) -> int:
        return self.kind.value.openai_status

    def openai_body(self) -> dict:
        code = self.kind.name.lower()
        return {"error": {"message": self.message, "type": self.kind.value.openai_type,
                          "param": self.param, "code": code}}

    # -- TGI dialect ------------------------------------------------------------------
    @property
    def tgi_status(self) -> int:
        return self.kind.value.tgi_status

    def tgi_body(self) -> dict:
        prefix = {ErrorKind.VALIDATION: "Input validation error: ",
                  ErrorKind.GENERATION: "Request failed during generation: ",
                  ErrorKind.TEMPLATE: "Template error: ", ErrorKind.TOOL: "Tool error: "}.get(self.kind, "")
        return {"error": prefix + self.message, "error_type": self.kind.value.tgi_type}

    def render(self, dialect: str) -> JSONResponse:
        registered = _DIALECTS.get(dialect)
        if registered is not None:
            return registered.render(self)
        if dialect == "openai":
            return SafeJSONResponse(self.openai_body(), self.openai_status, self.headers)
        return SafeJSONResponse(self.tgi_body(), self.tgi_status, self.headers)

    def stream_event(self, dialect: str) -> str:
        """The error as the last event(s) of an SSE stream that has already begun: OpenAI's
        `data: {"error": {...}}` then `data: [DONE]`; TGI's `data:{"error", "error_type"}`."""
        registered = _DIALECTS.get(dialect)
        if registered is not None:
            return registered.stream_event(self)
        if dialect == "openai":
            body = {"error": {**self.openai_body()["error"], "http_status_code": self.openai_status}}
            return sse_data(body) + sse_data("[DONE]")
        return sse_data(self.tgi_body(), "tgi")


_HTTP_KINDS = {400: ErrorKind.VALIDATION, 401: ErrorKind.AUTHENTICATION, 404: ErrorKind.NOT_FOUND,
               405: ErrorKind.METHOD_NOT_ALLOWED, 413: ErrorKind.PAYLOAD_TOO_LARGE, 422: ErrorKind.VALIDATION,
               429: ErrorKind.OVERLOADED, 503: ErrorKind.UNAVAILABLE}


def from_http_status(status: int, message: str, headers: dict[str, str] | None = None) -> GatewayError:
    """The framework's own HTTP errors (unknown route, wrong method, unreadable body) as
    an error of our taxonomy, so they render in the route's dialect like every other."""
    kind = _HTTP_KINDS.get(status, ErrorKind.VALIDATION if status < 500 else ErrorKind.INTERNAL)
    return GatewayError(kind, message, headers=headers)


def invalid(message: str, param: str | None = None, kind: ErrorKind = ErrorKind.VALIDATION) -> GatewayError:
    """A request the client must fix (400 on OpenAI routes, 422 on TGI's), naming `param`."""
    return GatewayError(kind, message, param)



class SafeJSONResponse(JSONResponse):
    """JSONResponse rendered with our encoder (no NaN/inf ever reaches a client)."""

    def __init__(self, body, status: int = 200, headers: dict | None = None):
        super().__init__(content=body, status_code=status, headers=headers)

    def render(self, content) -> bytes:
        text = json_dumps(content)
        try:
            return text.encode()
        except UnicodeEncodeError:  # a lone surrogate echoed from the request: escape it, stay valid JSON
            return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class _Dialect:
    path_prefix: str
    render: Callable[[GatewayError], JSONResponse]
    stream_event: Callable[[GatewayError], str]


_DIALECTS: dict[str, _Dialect] = {}


def register_dialect(name: str, path_prefix: str, render: Callable[[GatewayError], JSONResponse],
                     stream_event: Callable[[GatewayError], str]) -> None:
    """Errors on `path_prefix` and below are `name`'s: `render` makes the response, `stream_event`
    the last event of a stream already begun (the app's handlers, the body guard, the drain
    and the 500 middleware all ask `dialect_for_path`)."""
    _DIALECTS[name] = _Dialect(path_prefix, render, stream_event)


def dialect_for_path(path: str) -> str:
    """A registered dialect's under its prefix; OpenAI's error shape under /v1/, TGI's everywhere else."""
    for name, dialect in _DIALECTS.items():
        if path == dialect.path_prefix or path.startswith(dialect.path_prefix + "/"):
            return name
    return "openai" if path.startswith("/v1/") or path == "/v1" else "tgi"


class InternalErrors:
    """ASGI middleware: an exception a route lets escape becomes a 500 in the route's
    dialect ("internal error", no class or internals; the traceback goes to the log),
    and the connection stays usable. (Starlette's handler for Exception re-raises to
    uvicorn, which then closes the keep-alive connection under the client's next
    request.) A response already under way is ended where it stands."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False}

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001 - logged here, rendered without internals
            logger.exception("unhandled error on %s", scope.get("path"))
            if not state["started"]:
                error = GatewayError(ErrorKind.INTERNAL, "internal error")
                await error.render(dialect_for_path(scope["path"]))(scope, receive, send)
            elif not state["ended"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})


# A param that starts with this names the field in the request's own dialect already: a part another
# dialect's parser translated into a chat part keeps its place (gateway/openai/images.py ORIGIN).
DIALECT_PARAM = "@"


def renamed_error(error: GatewayError, params, words) -> GatewayError:
    """`error` in another dialect's field names than the chat route's it was raised in: `params`,
    (compiled pattern, replacement) pairs, the first that matches renames its param; `words`,
    (chat word, dialect word) pairs, replace words of its message. `error` itself where nothing
    changes."""
    param = error.param
    if param is not None and param.startswith(DIALECT_PARAM):
        param = param[len(DIALECT_PARAM):]  # the dialect's own name already (a translated part's)
    else:
        for pattern, replacement in params:
            if param is not None and pattern.search(param):
                param = pattern.sub(replacement, param)
                break
    message = error.message
    for chat_word, word in words:
        message = message.replace(chat_word, word)
    if param == error.param and message == error.message:
        return error
    renamed = GatewayError(error.kind, message, param)
    renamed.__cause__ = error
    return renamed
