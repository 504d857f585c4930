"""Switchyard workers behind the SGLang router (`sglang-router`, its regular HTTP-worker
mode), end to end: two real `switchyard serve` processes of the default model on free ports
and the router in front, with the cache-aware policy.

- OpenAI chat and completions, streamed and not, through the router and straight to a
  worker, give the same greedy answer; so does SGLang's own `/generate`.
- Requests that share a long prefix all go to one worker, whose prefix cache then serves it.
- A worker killed in the middle of a stream: that stream ends without `[DONE]`, the router
  takes the worker out of rotation, and every later request is answered by the survivor.

Skipped, saying so, only where the router cannot be imported or does not run here."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from switchyard.core.testing.serving import free_port

pytestmark = pytest.mark.slow

try:
    import sglang_router  # noqa: F401
except ImportError:  # pragma: no cover - the test extra installs it
    pytest.skip("sglang-router is not installed (pip install 'switchyard[router]')", allow_module_level=True)

NUM_WORKERS = 2
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model
COUNT = "1, 2, 3, 4,"
# a long shared system prompt (~200 tokens): what cache-aware routing keeps on one worker
SYSTEM = ("You are a careful assistant for a railway switchyard. " * 20).strip()


def _wait(check, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended ({proc.returncode}): {proc.stdout.read()[-3000:]}")
        try:
            result = check()
            if result:
                return result
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Cluster:
    def __init__(self):
        self.workers: list[tuple[subprocess.Popen, str]] = []
        self.router: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for _ in range(NUM_WORKERS):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "switchyard.gateway.cli", "serve", "--hostname", "127.0.0.1",
                 "--port", str(port), "--max-batch-total-tokens", "2048", "--enforce-eager",
                 "--graceful-shutdown-timeout", "5"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            self.workers.append((proc, f"http://127.0.0.1:{port}"))
        for proc, url in self.workers:
            _wait(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 300, f"worker {url}", proc)
        port = free_port()
        self.router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--policy", "cache_aware", "--worker-urls", *[url for _, url in self.workers],
             "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--prometheus-port", str(free_port()),  # its default (29000) may be taken
             "--log-level", "warn"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.url = f"http://127.0.0.1:{port}"
        _wait(lambda: len(self.healthy_workers()) == NUM_WORKERS, 120, "the router's workers", self.router)

    def healthy_workers(self) -> list[str]:
        body = httpx.get(self.url + "/workers", timeout=5).json()
        return [w["url"] for w in body["workers"] if w["is_healthy"]]

    def close(self) -> None:
        for proc in [self.router, *(p for p, _ in self.workers)]:
            if proc is not None:
                _stop(proc)
            if proc is not None and proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture(scope="module")
def cluster():
    try:
        cluster = Cluster()
        cluster.start()
    except OSError as exc:  # pragma: no cover - the router's binary cannot run on this platform
        cluster.close()
        pytest.skip(f"sglang-router cannot run here: {exc}")
    try:
        yield cluster
    finally:
        cluster.close()


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{name}(?:_total)?(?:{{}})? ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _successes(cluster: Cluster) -> dict[str, float]:
    return {url: _counter(url, "tgi_request_success") for _, url in cluster.workers}


def _chat(base: str, content: str, stream: bool = False, system: str | None = None, max_tokens: int = 8):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return httpx.post(base + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream})


def _streamed_text(response: httpx.Response, key) -> tuple[str, bool]:
    pieces, done = [], False
    for line in response.text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        pieces.append(key(chunk) or "")
    return "".join(pieces), done


def test_router_lists_the_model_from_server_info(cluster):
    models = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"]
    worker_model = httpx.get(cluster.workers[0][1] + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert [m["id"] for m in models] == [worker_model] == [MODEL]


def test_chat_and_completions_through_the_router_match_a_worker(cluster):
    worker = cluster.workers[0][1]
    for base in (cluster.url, worker):
        direct = _chat(base, "Count: 1, 2, 3,")
        assert direct.status_code == 200, direct.text
    routed, direct = _chat(cluster.url, "Count: 1, 2, 3,").json(), _chat(worker, "Count: 1, 2, 3,").json()
    assert routed["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]

    streamed = _chat(cluster.url, "Count: 1, 2, 3,", stream=True)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    text, done = _streamed_text(streamed, lambda c: c["choices"][0]["delta"].get("content") if c["choices"] else "")
    assert done and text == direct["choices"][0]["message"]["content"]

    body = {"model": MODEL, "prompt": COUNT, "max_tokens": 6, "temperature": 0}
    routed = httpx.post(cluster.url + "/v1/completions", json=body, timeout=300)
    direct = httpx.post(worker + "/v1/completions", json=body, timeout=300)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    streamed = httpx.post(cluster.url + "/v1/completions", json={**body, "stream": True}, timeout=300)
    text, done = _streamed_text(streamed, lambda c: c["choices"][0]["text"] if c["choices"] else "")
    assert done and text == direct.json()["choices"][0]["text"]


def test_sglang_generate_through_the_router(cluster):
    body = {"text": COUNT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    routed = httpx.post(cluster.url + "/generate", json=body, timeout=300)
    assert routed.status_code == 200, routed.text
    direct = httpx.post(cluster.workers[1][1] + "/generate", json=body, timeout=300).json()
    assert routed.json()["text"] == direct["text"]
    assert routed.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    streamed = httpx.post(cluster.url + "/generate", json={**body, "stream": True}, timeout=300)
    chunks = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["text"] == direct["text"]
    bad = httpx.post(cluster.url + "/generate", json={"text": COUNT, "sampling_params": {"temperature": -1}},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.temperature"


def test_cache_aware_routing_keeps_a_shared_prefix_on_one_worker(cluster):
    before = _successes(cluster)
    hits_before = {url: _counter(url, "switchyard_prefix_cache_hit_tokens") for _, url in cluster.workers}
    for i in range(6):
        r = _chat(cluster.url, f"Question {i}: which track?", system=SYSTEM, max_tokens=2)
        assert r.status_code == 200, r.text
    after = _successes(cluster)
    served = {url: after[url] - before[url] for url in after}
    assert sorted(served.values()) == [0, 6], served
    (chosen,) = [url for url, n in served.items() if n]
    hits = _counter(chosen, "switchyard_prefix_cache_hit_tokens") - hits_before[chosen]
    assert hits >= 5 * 150, hits  # the five later requests found the system prompt cached


def test_a_worker_killed_mid_stream_is_taken_out_of_rotation(cluster):
    # a fresh prefix, long answer: find which worker serves it, then kill that one mid-stream
    prefix = "Write a long story about trains and signals, in many sentences. " * 4
    before = _successes(cluster)
    assert _chat(cluster.url, prefix, max_tokens=1).status_code == 200
    after = _successes(cluster)
    (victim,) = [url for url in after if after[url] > before[url]]
    victim_proc = next(proc for proc, url in cluster.workers if url == victim)
    survivor = next(url for _, url in cluster.workers if url != victim)

    outcome: dict = {}

    def stream() -> None:
        try:
            with httpx.stream("POST", cluster.url + "/v1/chat/completions", timeout=300, json={
                    "model": MODEL, "messages": [{"role": "user", "content": prefix}], "max_tokens": 400,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
                outcome["status"] = r.status_code
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 6:
                        outcome["started"] = True
                outcome["lines"] = lines
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=stream)
    thread.start()
    _wait(lambda: outcome.get("started") or outcome.get("lines") is not None, 120, "the stream to start")
    victim_proc.kill()
    victim_proc.wait(30)
    thread.join(120)
    assert not thread.is_alive()
    assert outcome.get("error") is not None or "data: [DONE]" not in outcome.get("lines", []), outcome

    _wait(lambda: cluster.healthy_workers() == [survivor], 60, "the router to drop the killed worker")
    before = _counter(survivor, "tgi_request_success")
    for i in range(4):
        r = _chat(cluster.url, f"{prefix} {i}", max_tokens=2)
        assert r.status_code == 200, r.text
    assert _counter(survivor, "tgi_request_success") - before == 4
