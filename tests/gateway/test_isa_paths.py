"""The README's question and batch invariance through the server, on the path `switchyard serve`
takes by default (the packed GGUF, integer kernels, every step in C++), at every instruction-set
level this CPU runs (`--cpu-isa`): an AVX-512 machine serves through the AVX2 loops too, as an
AVX2-only laptop would, and through the portable C++ an ARM machine runs.

Invariance: a request's greedy tokens and log-probabilities, to the bit, do not depend on
- what else is in the batch (N distinct requests at once against each alone),
- how its prompt was chunked (a 64-token step budget, shared with whatever else runs),
- a cached prefix (the same prompt again, its full blocks from the prefix cache),
- streaming (the same request streamed).
The portable level (plain C++ loops, what an ARM machine runs) takes every test too: its three
add about 40 s on a 2-core machine.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from switchyard.backends.cpu.extension import isa_levels

from served_engine import MODEL_NAME, default_engine_config, start_engine, stop_engine

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOPICS = ["the sea", "a clock", "bread", "winter", "a bridge", "the moon"]
# long enough to be cut into several chunks under a 64-token budget, and to fill cache blocks
LONG = ("Here is a list of facts about rivers, mountains and the weather in many countries. " * 8
        + "Summarise it in one sentence:")


@pytest.fixture(scope="module", params=isa_levels())
def isa_server(request, start_server):
    client = start_engine(default_engine_config(isa=request.param, max_num_batched_tokens=64))
    running = start_server(client=client)
    running.isa = request.param
    yield running
    running.uvicorn_server.should_exit = True
    stop_engine(client)


def _body(messages, max_tokens: int = 24, **extra) -> dict:
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, **extra}


def _answer(choice: dict) -> tuple:
    """The tokens and every log-probability of a chat choice, exactly as sent."""
    return tuple((t["token"], t["logprob"], tuple((a["token"], a["logprob"]) for a in t["top_logprobs"]))
                 for t in choice["logprobs"]["content"])


async def _ask(client: httpx.AsyncClient, body: dict) -> tuple:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return _answer(response.json()["choices"][0])


async def _ask_streamed(client: httpx.AsyncClient, body: dict) -> tuple:
    tokens = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"]
                if choice and choice[0].get("logprobs"):
                    tokens.extend(_answer(choice[0]))
    return tuple(tokens)


def _run(server, coro_fn):
    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            return await coro_fn(client)
    return asyncio.run(main())


def test_the_readmes_question_gets_the_readmes_answer(isa_server):
    response = httpx.post(isa_server.openai_url + "/chat/completions", timeout=600,
                          json={"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 32, "temperature": 0})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    info = httpx.get(isa_server.base_url + "/info").json()
    assert info["isa"].startswith(isa_server.isa)
    assert info["quantized_activations"] == "int8x2"  # "auto" on a 135M model: two passes, on every level


def test_concurrent_requests_equal_each_alone(isa_server):
    """N distinct requests at once (their prompts chunked beside each other's decodes) against each
    sent alone: the same tokens and log-probabilities, to the bit."""
    bodies = [_body([{"role": "user", "content": f"Write two sentences about {topic}."}]) for topic in TOPICS]
    bodies.append(_body([{"role": "user", "content": LONG}]))

    async def together(client):
        return await asyncio.gather(*(_ask(client, body) for body in bodies))

    async def alone(client):
        return [await _ask(client, body) for body in bodies]

    crowd = _run(isa_server, together)
    isa_server.wait_idle()
    single = _run(isa_server, alone)
    for body, a, b in zip(bodies, crowd, single):
        assert a == b, body["messages"][0]["content"]


def test_a_cached_prefix_and_streaming_change_nothing(isa_server):
    """A long prompt cold, then again with its full blocks from the prefix cache, then streamed."""
    body = _body([{"role": "user", "content": LONG + " Be brief."}], max_tokens=16)

    async def three(client):
        cold = await _ask(client, body)
        cached = await _ask(client, body)
        streamed = await _ask_streamed(client, body)
        return cold, cached, streamed

    cold, cached, streamed = _run(isa_server, three)
    assert cold == cached
    assert streamed == cold
