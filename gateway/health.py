"""The health answer shared by the app's /health and /ping and TGI's GET / (tgi/routes.py)."""
from __future__ import annotations

from fastapi.responses import Response

from switchyard.core.client import EngineClient

from .errors import SafeJSONResponse


def health_response(client: EngineClient) -> Response:
    """200 once warmed up; TGI's 503 body before that (/health, /ping, GET /)."""
    if not client.ready:
        return SafeJSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, 503)
    return Response(status_code=200)
