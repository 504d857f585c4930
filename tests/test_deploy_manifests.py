"""The Kubernetes manifests in deploy/kubernetes/ against the code they run: every
`switchyard serve` command parses with the real CLI, probes and Prometheus scrape paths are
routes of the app, ports match `--port`, the grace period outlasts preStop plus the drain, and
the router's workers and flags are real."""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from starlette.routing import Match

from switchyard.gateway.app import create_app
from switchyard.gateway.cli import build_parser
from switchyard.gateway.settings import ServerSettings

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def _documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _pod_specs() -> list[tuple[str, dict, dict]]:
    """(where, pod template metadata, pod spec) of every workload, KubeRay's groups included."""
    specs = []
    for name, doc in _documents():
        kind = doc["kind"]
        if kind in ("Deployment", "StatefulSet"):
            templates = [doc["spec"]["template"]]
        elif kind == "RayCluster":
            templates = [doc["spec"]["headGroupSpec"]["template"]] + [
                group["template"] for group in doc["spec"].get("workerGroupSpecs", ())]
        else:
            continue
        for template in templates:
            specs.append((f"{name}:{doc['metadata']['name']}", template.get("metadata", {}), template["spec"]))
    return specs


def _serve_args(container: dict) -> list[str] | None:
    """The arguments after `switchyard serve` in the container's command line (a plain command or
    an `sh -c` script), or None if it does not run the server."""
    words = [*container.get("command", ()), *container.get("args", ())]
    if words[:2] == ["sh", "-c"]:
        script = " ".join(words[2:])
        match = re.search(r"switchyard serve ([^;&|]*)", script)
        return shlex.split(match.group(1)) if match else None
    if words[:2] == ["switchyard", "serve"]:
        return [str(w) for w in words[2:]]
    return None


def _servers() -> list[tuple[str, dict, dict, dict, object]]:
    found = []
    for where, meta, spec in _pod_specs():
        for container in spec["containers"]:
            args = _serve_args(container)
            if args is not None:
                found.append((f"{where}/{container['name']}", meta, spec, container, args))
    return found


class _Routes:
    """`path in routes`: the app answers GET on that path (a route matches it fully)."""

    def __init__(self, app):
        self._app = app

    def __contains__(self, path: str) -> bool:
        scope = {"type": "http", "path": path, "method": "GET", "root_path": "", "query_string": b"",
                 "headers": []}
        return any(route.matches(scope)[0] is Match.FULL for route in self._app.router.routes)


@pytest.fixture(scope="module")
def routes() -> _Routes:
    return _Routes(create_app(ServerSettings(model_id="m"), SimpleNamespace()))


def test_the_route_check_can_fail(routes):
    assert "/health" in routes and "/metrics" in routes and "/no-such-route" not in routes


def _parse(args: list[str]):
    try:
        return build_parser({}).parse_args(["serve", *args])
    except SystemExit as exc:  # argparse has printed which flag or value is wrong
        raise AssertionError(f"not valid `switchyard serve` arguments: {args}") from exc


def _port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


def test_the_manifests_cover_each_deployment():
    kinds = {(name, doc["kind"]) for name, doc in _documents()}
    assert {("switchyard.yaml", "Deployment"), ("switchyard.yaml", "Service"),
            ("servicemonitor.yaml", "ServiceMonitor"), ("router.yaml", "StatefulSet"),
            ("router.yaml", "Deployment"), ("raycluster.yaml", "RayCluster")} <= kinds
    assert len(_servers()) == 3


def test_serve_commands_are_real_flags_and_probes_are_real_routes(routes):
    for where, meta, spec, container, args in _servers():
        parsed = _parse(args)
        assert parsed.hostname == "0.0.0.0", where  # reachable from the kubelet and the Service
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] in routes, (where, probe, get["path"])
            assert _port_number(container, get["port"]) == parsed.port, (where, probe)
        assert container["readinessProbe"]["httpGet"]["path"] == "/health", where
        annotations = meta.get("annotations", {})
        assert annotations.get("prometheus.io/path") in routes, where
        assert int(annotations["prometheus.io/port"]) == parsed.port, where
        assert container["resources"]["requests"] and container["resources"]["limits"], where


def test_the_grace_period_outlasts_pre_stop_and_the_drain():
    for where, _, spec, container, args in _servers():
        parsed = _parse(args)
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep", where
        assert spec["terminationGracePeriodSeconds"] > float(pre_stop[1]) + parsed.graceful_shutdown_timeout, where


def test_the_ray_example_uses_the_ray_shard_launcher():
    (ray,) = [args for where, *_, args in _servers() if where.startswith("raycluster.yaml")]
    parsed = _parse(ray)
    assert parsed.distributed_executor_backend == "ray"
    assert parsed.num_shard == 3


def test_services_and_the_service_monitor_point_at_named_ports(routes):
    named = {}
    for where, meta, spec in _pod_specs():
        for container in spec["containers"]:
            for port in container.get("ports", ()):
                named.setdefault(port.get("name"), set()).add(port["containerPort"])
    for name, doc in _documents():
        if doc["kind"] == "Service":
            for port in doc["spec"]["ports"]:
                target = port["targetPort"]
                assert isinstance(target, int) or target in named, (name, doc["metadata"]["name"], target)
        if doc["kind"] == "ServiceMonitor":
            for endpoint in doc["spec"]["endpoints"]:
                assert endpoint["path"] in routes and endpoint["port"] in named, endpoint


def test_the_router_points_at_the_workers_with_real_router_flags():
    docs = {(doc["kind"], doc["metadata"]["name"]): doc for name, doc in _documents() if name == "router.yaml"}
    workers = docs[("StatefulSet", "switchyard-worker")]
    headless = docs[("Service", workers["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    (_, _, _, _, worker_args) = next(s for s in _servers() if s[0].startswith("router.yaml"))
    port = _parse(worker_args).port
    router = docs[("Deployment", "switchyard-router")]["spec"]["template"]["spec"]["containers"][0]
    args = [str(a) for a in router["args"]]
    urls = args[args.index("--worker-urls") + 1:]
    urls = urls[:next((i for i, a in enumerate(urls) if a.startswith("--")), len(urls))]
    name = workers["metadata"]["name"]
    assert urls == [f"http://{name}-{i}.{headless['metadata']['name']}:{port}"
                    for i in range(workers["spec"]["replicas"])]
    launch_router = pytest.importorskip("sglang_router.launch_router", reason="sglang-router is not installed")
    parsed = launch_router.parse_router_args(args)
    assert parsed.policy == "cache_aware" and parsed.worker_urls == urls
