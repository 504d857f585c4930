"""The health answer shared by the app's /health and /ping and TGI's GET / (tgi/routes.py)."""
from __future__ import annotations

from fastapi.responses import Response

from switchyard.core.engine.client import EngineClient

from .errors import RETRY_AFTER_SECONDS, SafeJSONResponse


def health_response(client: EngineClient) -> Response:
    """200 while the engine serves: warmed up and still running, asked of the client at each call
    (`ready` checks the engine's process), so a dead engine is 503 from the moment it has ended.
    TGI's 503 body otherwise (/health, /ping, GET /), with Retry-After while the model loads (not
    once the engine has stopped for good: the server exits then)."""
    if not client.ready:
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)} if not client.engine_gone else None
        return SafeJSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, 503, headers=retry)
    return Response(status_code=200)
