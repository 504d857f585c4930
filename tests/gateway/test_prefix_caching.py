"""Prefix caching as the gateway exports it: hit counters and rate in /metrics, over
HTTP on the shared server; `switchyard serve --disable-prefix-caching` as a process."""
from __future__ import annotations

import re

import httpx
import pytest

from switchyard.core.engine.client import EngineLoad, StepStats
from switchyard.gateway.metrics import Metrics

SYSTEM = ("You answer questions about a small library. Opening hours are nine to five on weekdays and ten to "
          "two on Saturdays; it is closed on Sundays. Members may borrow six books for three weeks, renew them "
          "twice online, and reserve up to four titles. Late returns cost twenty pence a day per book. ")


def _stats(queried: int, hit: int) -> StepStats:
    return StepStats(load=EngineLoad(num_running=1, num_waiting=0, num_kv_blocks_used=1, num_kv_blocks_total=10),
                     num_scheduled_tokens=queried - hit, num_prefill_tokens=0, num_decodes=0, duration_s=0.01,
                     num_prefix_queried_tokens=queried, num_prefix_hit_tokens=hit)


def test_hit_counters_and_rate_add_up_over_steps():
    metrics = Metrics()
    metrics.observe_step(_stats(100, 0), block_size=16)
    metrics.observe_step(_stats(100, 64), block_size=16)
    metrics.observe_step(_stats(0, 0), block_size=16)  # a step without admissions changes nothing
    text = metrics.render()
    assert _metric(text, "switchyard_prefix_cache_queried_tokens") == 200
    assert _metric(text, "switchyard_prefix_cache_hit_tokens") == 64
    assert _metric(text, "switchyard_prefix_cache_hit_rate") == pytest.approx(0.32)
    assert "# TYPE switchyard_prefix_cache_hit_tokens counter" in text


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_repeated_prompt_is_served_from_the_cache_over_http(start_server):
    # A server of its own: the shared engine reports its steps to the last app created.
    http = httpx.Client(base_url=start_server().base_url, timeout=60)
    body = {"inputs": SYSTEM + "When does it open on Saturday?",
            "parameters": {"max_new_tokens": 4, "do_sample": False}}
    first = http.post("/generate", json=body)
    before = http.get("/metrics").text
    second = http.post("/generate", json=body)
    after = http.get("/metrics").text
    assert first.status_code == second.status_code == 200
    assert first.json()["generated_text"] == second.json()["generated_text"]
    hits = _metric(after, "switchyard_prefix_cache_hit_tokens") - _metric(before, "switchyard_prefix_cache_hit_tokens")
    queried = (_metric(after, "switchyard_prefix_cache_queried_tokens")
               - _metric(before, "switchyard_prefix_cache_queried_tokens"))
    assert hits >= 48 and queried >= hits  # the prompt's full blocks (all but its last token)
    assert 0 < _metric(after, "switchyard_prefix_cache_hit_rate") <= 1


def test_openai_usage_reports_the_prompt_tokens_served_from_the_cache(http):
    prompt = SYSTEM + "How many books may a member borrow?"
    body = {"model": "default", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    http.post("/v1/completions", json=body)  # fills the cache
    details = http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]
    streamed = _stream_usage(http, "/v1/completions", {**body, "n": 2})
    chat = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "temperature": 0}
    http.post("/v1/chat/completions", json=chat)
    chat_details = http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens_details"]
    # every full block of the prompt but the one holding its last token, counted once for n=2
    assert details["cached_tokens"] >= 48 and details["cached_tokens"] % 16 == 0
    assert streamed["prompt_tokens_details"]["cached_tokens"] == details["cached_tokens"]
    assert chat_details["cached_tokens"] >= 48
    fresh = http.post("/v1/completions", json={**body, "prompt": "Zebras " + prompt}).json()["usage"]
    assert fresh["prompt_tokens_details"]["cached_tokens"] == 0


def _stream_usage(http, path: str, body: dict) -> dict:
    import json

    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(e) for e in events if e != "[DONE]"][-1]["usage"]


@pytest.mark.slow
def test_serve_with_prefix_caching_disabled_keeps_nothing_between_requests():
    from test_serve import _start, _wait_healthy

    proc, url = _start("--disable-prefix-caching", "--max-batch-total-tokens", "2048")
    try:
        _wait_healthy(proc, url)
        body = {"inputs": SYSTEM + "How many books may I borrow?", "parameters": {"max_new_tokens": 2}}
        for _ in range(2):
            assert httpx.post(url + "/generate", json=body, timeout=120).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, "switchyard_prefix_cache_hit_tokens") == 0
        # n sequences of one prompt still share it (a share group), so those are hits
        body = {"inputs": SYSTEM + "Is it open on Sunday?",
                "parameters": {"max_new_tokens": 2, "best_of": 2, "do_sample": True}}
        assert httpx.post(url + "/generate", json=body, timeout=120).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, "switchyard_prefix_cache_hit_tokens") >= 48
    finally:
        proc.kill()
        proc.wait(30)


def test_requests_added_together_are_all_or_none(server):
    """submit_all's sequences reach the engine in one command: admitted in one step (so
    siblings share the prompt's blocks), or none of them if one is refused."""
    import asyncio

    from switchyard.core.params import SamplingParams, ValidationError
    from switchyard.core.scheduling.request import Request

    async def add_with_a_bad_one():
        good = Request("together-good", [1, 2, 3], SamplingParams(max_tokens=2))
        bad = Request("together-bad", [], SamplingParams(max_tokens=2))  # an empty prompt is refused
        with pytest.raises(ValidationError):
            await server.client.add_requests([good, bad])

    asyncio.run(add_with_a_bad_one())
    assert server.client.engine.scheduler.get_request("together-good") is None
    assert "together-good" not in server.client._streams
