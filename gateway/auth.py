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
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise GatewayError(ErrorKind.AUTHENTICATION, "invalid or missing API key (Authorization: Bearer ...)")
