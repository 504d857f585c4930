"""Errors on Anthropic's routes (`/v1/messages...`), in Anthropic's shape:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

with the status Anthropic gives each type. Registered with gateway/errors.py, so every
error on these paths, from the route, the body guard, auth, the framework or the drain,
is rendered so; an error after a stream began is one `event: error` with the same body.
Anthropic's body has no `param`: the field is named at the head of the message."""
from __future__ import annotations

from ..errors import ErrorKind, GatewayError, SafeJSONResponse, register_dialect
from ..streaming import sse_event

DIALECT = "anthropic"
PATH_PREFIX = "/v1/messages"

# each kind of the gateway's taxonomy -> (status, Anthropic's error type)
_WIRE: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.VALIDATION: (400, "invalid_request_error"),
    ErrorKind.TEMPLATE: (400, "invalid_request_error"),
    ErrorKind.TOOL: (400, "invalid_request_error"),
    ErrorKind.AUTHENTICATION: (401, "authentication_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.MODEL_NOT_FOUND: (404, "not_found_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorKind.PAYLOAD_TOO_LARGE: (413, "request_too_large"),
    # past --max-concurrent-requests: Anthropic's "overloaded" (the SDK and Claude Code retry it)
    ErrorKind.OVERLOADED: (529, "overloaded_error"),
    # loading, the engine stopped, shutting down: retried by the SDK like any 5xx (Retry-After)
    ErrorKind.UNAVAILABLE: (503, "overloaded_error"),
    ErrorKind.GENERATION: (500, "api_error"),
    ErrorKind.INCOMPLETE: (500, "api_error"),
    ErrorKind.INTERNAL: (500, "api_error"),
}


def status_of(error: GatewayError) -> int:
    return _WIRE[error.kind][0]


def error_body(error: GatewayError) -> dict:
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": _WIRE[error.kind][1], "message": message}}


def render(error: GatewayError) -> SafeJSONResponse:
    return SafeJSONResponse(error_body(error), status_of(error), error.headers)


def error_event(error: GatewayError) -> str:
    """An error once the stream has begun: the SDK raises it as the status's exception."""
    return sse_event("error", error_body(error))


register_dialect(DIALECT, PATH_PREFIX, render, error_event)
