"""The app's shared behaviour: health, metrics, auth, payload limit, errors."""
from __future__ import annotations

import httpx


def test_health_ping_metrics(http):
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200
    body = http.get("/metrics").text
    assert "# TYPE tgi_request_count counter" in body
    assert "tgi_batch_max_total_tokens" in body
