"""Errors of the gateway's one taxonomy (gateway/errors.py) as gRPC status codes.

The same GatewayError an HTTP route renders as a 4xx/5xx body ends an RPC with the code
a gRPC client retries or reports by: bad input INVALID_ARGUMENT, a 429 RESOURCE_EXHAUSTED,
loading, draining or a compile worker not ready UNAVAILABLE, a missing key UNAUTHENTICATED."""
from __future__ import annotations

import grpc

from switchyard.core.params import ValidationError

from ..errors import ErrorKind, GatewayError

_CODES = {
    ErrorKind.VALIDATION: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.TEMPLATE: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.TOOL: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.AUTHENTICATION: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.METHOD_NOT_ALLOWED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorKind.PAYLOAD_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.GENERATION: grpc.StatusCode.INTERNAL,
    ErrorKind.INCOMPLETE: grpc.StatusCode.ABORTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def status_code(kind: ErrorKind) -> grpc.StatusCode:
    return _CODES[kind]


def as_gateway_error(exc: BaseException) -> GatewayError:
    """What an exception that ends an RPC is in the taxonomy; anything unforeseen is INTERNAL."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, ValidationError):
        return GatewayError(ErrorKind.VALIDATION, str(exc), exc.param)
    return GatewayError(ErrorKind.INTERNAL, "internal error")


def details(error: GatewayError) -> str:
    """The status message: the error's message, naming the parameter when there is one."""
    if error.param and error.param not in error.message:
        return f"{error.param}: {error.message}"
    return error.message
