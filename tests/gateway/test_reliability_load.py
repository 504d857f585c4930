"""Reliability suite, load and faults: /metrics is true when the engine is idle; 1,000
concurrent streams are held (429 past the limit, nothing lost); 200 disconnects at
random moments give every block back and leave greedy output unchanged; SIGTERM ends
the streams still open at the drain deadline with an error event in their dialect."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time

import aiohttp
import httpx
import pytest

from reliability_servers import serve_draining, start_tiny

from switchyard.gateway.drain import SHUTDOWN_MESSAGE

LONG_CHAT = {"model": "default", "stream": True, "max_tokens": 400, "ignore_eos": True,
             "messages": [{"role": "user", "content": "Tell a long story."}]}
LONG_TGI = {"inputs": "Count from one to two hundred: one, two,", "parameters": {"max_new_tokens": 400}}


def _gauge(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _greedy(base_url: str) -> str:
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def tiny():
    with start_tiny(max_concurrent_requests=500) as server:
        yield server


def test_metrics_are_true_when_idle_after_an_abort(start_server):
    server = start_server()
    server.wait_idle()
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=LONG_CHAT) as response:
            lines = response.iter_lines()
            events = 0
            while events < 3:
                events += next(lines).startswith("data:")
            busy = http.get("/metrics").text
            assert _gauge(busy, "tgi_batch_current_size") >= 1
            assert _gauge(busy, "tgi_batch_current_max_tokens") > 0
        server.wait_idle()  # the abort freed everything; no step follows it
        deadline = time.monotonic() + 5
        while True:
            idle = http.get("/metrics").text
            if _gauge(idle, "tgi_batch_current_size") == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert _gauge(idle, "tgi_batch_current_size") == 0
    assert _gauge(idle, "tgi_batch_current_max_tokens") == 0
    assert _gauge(idle, "switchyard_kv_cache_usage_ratio") == 0
    assert _gauge(idle, "tgi_queue_size") == 0


# -- SIGTERM -----------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_ends_open_streams_with_an_error_event_in_their_dialect(engine_client, server):
    server.wait_idle()
    grace_s = 3.0
    draining, thread, url = serve_draining(engine_client, grace_s)
    results: dict[str, list] = {}
    started = threading.Barrier(3)

    def stream(name: str, path: str, body: dict) -> None:
        events, error = [], None
        try:
            with httpx.stream("POST", url + path, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        events.append(line[5:].strip())
                        if len(events) == 2:
                            started.wait(60)
        except Exception as exc:  # noqa: BLE001 - a truncated body lands here; checked below
            error = exc
        results[name] = [events, error]

    workers = [threading.Thread(target=stream, args=("openai", "/v1/chat/completions", LONG_CHAT)),
               threading.Thread(target=stream, args=("tgi", "/generate_stream", LONG_TGI))]
    for worker in workers:
        worker.start()
    started.wait(120)  # both streams are generating
    signalled = time.monotonic()
    draining.handle_exit(signal.SIGTERM, None)
    for worker in workers:
        worker.join(60)
    thread.join(30)
    assert time.monotonic() - signalled < grace_s + 2 and not thread.is_alive()
    openai_events, openai_error = results["openai"]
    assert openai_error is None, openai_error
    assert openai_events[-1] == "[DONE]"
    error = json.loads(openai_events[-2])["error"]
    assert error["message"] == SHUTDOWN_MESSAGE and error["code"] == "unavailable"
    assert error["http_status_code"] == 503
    tgi_events, tgi_error = results["tgi"]
    assert tgi_error is None, tgi_error
    assert json.loads(tgi_events[-1]) == {"error": SHUTDOWN_MESSAGE, "error_type": "unavailable"}
    assert all("error" not in json.loads(e) for e in tgi_events[:-1])
    server.wait_idle()  # the ended streams' requests were aborted, their blocks freed


# -- 1,000 concurrent streams --------------------------------------------------------------
async def _stream_once(session: aiohttp.ClientSession, url: str, i: int, statuses: list) -> tuple[int, str]:
    if i % 2:
        path, body = "/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 2, "stream": True,
                                         "ignore_eos": True}
    else:
        path, body = "/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    async with session.post(url + path, json=body) as response:
        statuses.append(response.status)
        text = await response.text()
        return response.status, text


def _complete(text: str, openai: bool) -> bool:
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    if openai:
        return events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    return json.loads(events[-1])["generated_text"] is not None  # the final event (EOS may come first)


@pytest.mark.slow
def test_a_thousand_concurrent_streams_are_held_429_past_the_limit_and_none_is_lost(tiny, monkeypatch):
    limit, total = 500, 1000  # the tiny server's --max-concurrent-requests is 500
    busy = tiny
    busy.wait_idle()
    runner = busy.client.engine.runner
    original, gate = runner.execute, threading.Event()

    def gated(scheduler_output):  # the engine holds every admitted stream until all have arrived
        gate.wait(120)
        return original(scheduler_output)

    monkeypatch.setattr(runner, "execute", gated)

    async def storm():
        statuses: list[int] = []
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=180)) as session:
            tasks = [asyncio.create_task(_stream_once(session, busy.base_url, i, statuses)) for i in range(total)]
            deadline = time.monotonic() + 120
            while statuses.count(429) < total - limit and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            held = busy.app.state.service.in_flight
            gate.set()
            return held, await asyncio.gather(*tasks)

    try:
        held, results = asyncio.run(storm())
    finally:
        gate.set()
    assert held == limit  # all 500 admitted streams were open at once
    refused = [i for i, (status, _) in enumerate(results) if status == 429]
    served = [i for i, (status, _) in enumerate(results) if status == 200]
    assert len(refused) == total - limit and len(served) == limit
    assert all(_complete(results[i][1], openai=bool(i % 2)) for i in served)  # nothing lost
    busy.wait_idle()
    assert busy.app.state.service.in_flight == 0


# -- 200 disconnects at random moments ---------------------------------------------------
@pytest.mark.slow
def test_two_hundred_random_disconnects_give_every_block_back(tiny):
    storm_server = tiny
    storm_server.wait_idle()
    expected = _greedy(storm_server.base_url)
    rng = random.Random(15)

    async def one(session, i: int) -> None:
        if i % 2:
            path, body = "/v1/completions", {"model": "default", "prompt": "Tell a long story.", "stream": True,
                                             "max_tokens": 900, "ignore_eos": True}
        else:
            path, body = "/generate_stream", {"inputs": "Tell a long story.", "parameters": {"max_new_tokens": 900}}
        async with session.post(storm_server.base_url + path, json=body) as response:
            await response.read()

    async def storm() -> int:
        gates = asyncio.Semaphore(40)
        cut = 0

        async def cut_at_random(session, i):
            nonlocal cut
            async with gates:
                task = asyncio.create_task(one(session, i))
                await asyncio.sleep(rng.uniform(0.0, 0.5))
                if not task.done():
                    cut += 1
                    task.cancel()  # aiohttp closes the connection: the server sees a disconnect
                await asyncio.gather(task, return_exceptions=True)

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(cut_at_random(session, i) for i in range(200)))
        return cut

    cut = asyncio.run(storm())
    assert cut >= 100  # most were cut mid-flight (900 tokens take longer than 0.5 s)
    storm_server.wait_idle(timeout=60)  # every request gone, every block back
    assert storm_server.client.num_unfinished == 0
    deadline = time.monotonic() + 10
    while storm_server.app.state.service.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert storm_server.app.state.service.in_flight == 0  # every admission slot released
    assert _greedy(storm_server.base_url) == expected
