"""deploy/grafana/switchyard.json against the live /metrics: every PromQL expression in the
dashboard parses (promql-parser, the Prometheus grammar), and every metric it selects is a
series the in-process app exports after a request: a histogram's `_bucket`, `_sum` and
`_count` included, so a renamed or removed metric fails here before a dashboard goes blank."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import promql_parser  # the test extra's promql-parser
import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "switchyard.json"
# Grafana's variables, as Grafana substitutes them before the query reaches Prometheus
VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$instance": ".*"}


def _targets(panels: list[dict]):
    for panel in panels:
        yield from ((panel["title"], target["expr"]) for target in panel.get("targets", ()))
        yield from _targets(panel.get("panels", ()))


def _selected_metrics(expr: str) -> set[str]:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def _exported_series(text: str) -> set[str]:
    return {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_is_grafana_json_with_its_variables(dashboard):
    assert dashboard["uid"] == "switchyard" and dashboard["panels"]
    names = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert names == {"datasource", "instance"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


@pytest.fixture()
def http(start_server):
    """A server of its own over the shared engine: an app takes the engine client's step statistics
    (create_app sets client.on_step), so the session's default server stops getting them once a
    later test has made another app over the same client."""
    import httpx

    with httpx.Client(base_url=start_server().base_url, timeout=120) as client:
        yield client


def test_every_metric_the_dashboard_queries_is_in_metrics(dashboard, http):
    """After one streamed and one whole request, each selected series is in /metrics."""
    for stream in (False, True):
        with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": stream}) as r:
            assert r.status_code == 200
            r.read()
    queried = {}
    for title, expr in _targets(dashboard["panels"]):
        for name in _selected_metrics(expr):
            queried.setdefault(name, title)
    # the engine's step statistics reach the metrics from its reader thread, after the answers:
    # on a loaded machine the last steps' may still be on their way
    deadline = time.monotonic() + 30
    while True:
        exported = _exported_series(http.get("/metrics").text)
        missing = {name: title for name, title in queried.items() if name not in exported}
        if not missing or time.monotonic() > deadline:
            break
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        time.sleep(0.2)
    assert not missing, f"queried but not exported: {missing}"
    histograms = {name[:-len("_bucket")] for name in queried if name.endswith("_bucket")}
    assert {"switchyard_time_to_first_token_seconds", "switchyard_inter_token_latency_seconds",
            "tgi_request_duration", "tgi_batch_next_size"} <= histograms
    assert {"tgi_request_count", "tgi_queue_size", "switchyard_kv_cache_usage_ratio",
            "switchyard_generation_tokens", "tgi_request_failure"} <= set(queried)


def test_a_query_of_a_metric_that_is_not_exported_would_fail():
    assert _selected_metrics('sum(rate(tgi_nope_bucket{instance=~"$instance"}[$__rate_interval]))') == \
        {"tgi_nope_bucket"}
    assert "tgi_nope_bucket" not in _exported_series("tgi_request_count 1\n")
    with pytest.raises(Exception):
        _selected_metrics("sum(rate(tgi_request_count[1m])")  # unbalanced: not PromQL
