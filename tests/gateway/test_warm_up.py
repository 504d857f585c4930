"""Warm when ready (issue 37): the start-up warm-up renders chat turns with the model's own
template, so the first chat request of a fresh server finds the template's head (SmolLM2's
default system prompt) in the prefix cache, as the tenth does, and pays no more than it
(benchmarks/first_requests.py measures the times). The default model, on the default path."""
from __future__ import annotations

import asyncio

import pytest

from switchyard.core.engine.loop import WARM_UP_TURNS
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.text.chat_template import compiled_template, sample_turn

from served_engine import default_engine_config, start_engine, stop_engine

pytestmark = pytest.mark.slow


def _first_output(client, prompt_ids: list[int]):
    async def run():
        stream = await client.add_request(Request("first", prompt_ids, SamplingParams(max_tokens=2, temperature=0.0)))
        return [out async for out in stream][0]
    return asyncio.run(run())


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_the_first_chat_request_finds_the_template_head_cached():
    client = start_engine(default_engine_config())
    try:
        tokenizer = client.tokenizer
        # compiled before ready (here the engine's warm-up and the client share one process; the
        # client's own compile is tested in tests/core/test_engine_process.py): rendering is a cache hit
        misses = compiled_template.cache_info().misses
        text = sample_turn(tokenizer, "What is the capital of France?")
        assert text is not None and compiled_template.cache_info().misses == misses
        prompt = tokenizer.encode(text, add_special_tokens=False)
        warm = tokenizer.encode(sample_turn(tokenizer, WARM_UP_TURNS[0]), add_special_tokens=False)
        shared = _common_prefix(prompt, warm)
        assert shared >= 16, "SmolLM2's template starts every turn with its default system prompt"
        out = _first_output(client, prompt)
        # the template's whole head: its full blocks, and the rest copied (a partial hit: core/kv)
        assert out.num_cached_tokens == shared
    finally:
        stop_engine(client)
