"""One error taxonomy, rendered in the OpenAI shape or the TGI shape.

OpenAI routes (`/v1/...`): `{"error": {"message", "type", "param", "code"}}`.
TGI routes: `{"error": str, "error_type": str}`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from .streaming import json_dumps


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
    PAYLOAD_TOO_LARGE = _Kind(413, "invalid_request_error", 413, "payload_too_large")
    OVERLOADED = _Kind(429, "rate_limit_error", 429, "overloaded")
    GENERATION = _Kind(500, "server_error", 424, "generation")
    INCOMPLETE = _Kind(500, "server_error", 500, "incomplete_generation")
    UNAVAILABLE = _Kind(503, "service_unavailable", 503, "unavailable")
    INTERNAL = _Kind(500, "server_error", 500, "internal")


RETRY_AFTER_SECONDS = 1


class GatewayError(Exception):
    """An error value with a kind; routes raise it, the app renders it per dialect."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    @property
    def headers(self) -> dict[str, str] | None:
        return {"retry-after": str(RETRY_AFTER_SECONDS)} if self.kind is ErrorKind.OVERLOADED else None

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
        if dialect == "openai":
            return SafeJSONResponse(self.openai_body(), self.openai_status, self.headers)
        return SafeJSONResponse(self.tgi_body(), self.tgi_status, self.headers)


def invalid(message: str, param: str | None = None, kind: ErrorKind = ErrorKind.VALIDATION) -> GatewayError:
    """A request the client must fix (400 on OpenAI routes, 422 on TGI's), naming `param`."""
    return GatewayError(kind, message, param)



class SafeJSONResponse(JSONResponse):
    """JSONResponse rendered with our encoder (no NaN/inf ever reaches a client)."""

    def __init__(self, body, status: int = 200, headers: dict | None = None):
        super().__init__(content=body, status_code=status, headers=headers)

    def render(self, content) -> bytes:
        return json_dumps(content).encode()


def dialect_for_path(path: str) -> str:
    """OpenAI's error shape under /v1/, TGI's everywhere else."""
    return "openai" if path.startswith("/v1/") or path == "/v1" else "tgi"
