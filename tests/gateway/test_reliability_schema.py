"""Reliability suite, fuzzing: a bounded schemathesis run over every operation of
/openapi.json (valid and schema-violating bodies, both dialects) against a real server
on loopback; no answer may be a 5xx, and every error is JSON."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from reliability_servers import start_tiny

MAX_EXAMPLES = 5  # per operation (~15 operations): bounded, well under a minute on 2 cores


@pytest.fixture(scope="module")
def fuzzed_server():
    """The toy model (every route and check is real; its steps take milliseconds), with
    generations of at most 64 tokens in all so that valid requests stay quick."""
    with start_tiny(max_total_tokens=64, max_input_tokens=48) as server:
        yield server


@pytest.fixture
def openapi(fuzzed_server):
    return schemathesis.openapi.from_url(fuzzed_server.base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("openapi")


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_5xx(case):
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        content_type = response.headers.get("content-type") or [""]
        content_type = content_type[0] if isinstance(content_type, list) else content_type
        assert content_type.startswith("application/json"), (case.method, case.path, response.status_code,
                                                             response.text[:200])
        assert "error" in response.json()
