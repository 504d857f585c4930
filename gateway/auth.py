"""The API key check: a FastAPI dependency of every inference route (both dialects' routers
and the app's own use it, so it lives apart from all of them)."""
from __future__ import annotations

import hmac

from fastapi import Request

from .errors import ErrorKind, GatewayError


def require_api_key(request: Request) -> None:
    """Dependency of every inference route: `Authorization: Bearer <--api-key>`."""
    key = request.app.state.settings.api_key
    if key is None:
        return
    if not bearer_matches(request.headers.get("authorization", ""), key):
        raise GatewayError(ErrorKind.AUTHENTICATION, "invalid or missing API key (Authorization: Bearer ...)")


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an `Authorization` value (an HTTP header, gRPC metadata) is `Bearer <key>`."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
