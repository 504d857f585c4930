"""The default model (SmolLM2-135M-Instruct) served end to end through the XPU backend on the
CPU device: greedy tokens equal to the CPU backend's (prompt chunks with a cached prefix,
batched decodes), and one OpenAI completion over HTTP through the real app."""
from __future__ import annotations

import asyncio
import time

import pytest

from switchyard.backends.xpu.ipex import load as load_ipex  # noqa: E402

try:  # IPEX, fitting this torch: only in the xpu environment (.ci/backend_env.sh xpu)
    load_ipex()
except ImportError as error:
    pytest.skip(str(error), allow_module_level=True)

from fastapi.testclient import TestClient  # noqa: E402

from switchyard.backends.cpu import CpuBackend  # noqa: E402
from switchyard.backends.xpu import XpuBackend  # noqa: E402
from switchyard.core.engine.client import InProcessEngineClient  # noqa: E402
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from switchyard.core.engine.core import EngineCore  # noqa: E402
from switchyard.core.loader import load_tokenizer  # noqa: E402
from switchyard.core.params import SamplingParams  # noqa: E402
from switchyard.core.scheduling.request import Request  # noqa: E402
from switchyard.gateway.app import create_app  # noqa: E402
from switchyard.gateway.settings import ServerSettings  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ("The capital of France is", "Write a haiku about the sea.",
           "The capital of France is a city where")  # shares a cached prefix with the first
MAX_TOKENS = 12


def _config() -> EngineConfig:
    # a 24-token step budget chunks the longer prompts; 16-token blocks; the GGUF dequantized on
    # both backends (the CPU would otherwise multiply its own blocks)
    return EngineConfig(model=ModelConfig(quantize="none"), cache=CacheConfig(block_size=16, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8))


def _greedy(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out: dict[str, list[int]] = {}
    engine.add_request(Request("first", prompts[0], params))
    for _ in range(3):  # the first prompt's blocks are cached before the others arrive
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i, prompt in enumerate(prompts[1:], 1):
        engine.add_request(Request(f"r{i}", prompt, params))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out["first"]] + [out[f"r{i}"] for i in range(1, len(prompts))]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig())


@pytest.fixture(scope="module")
def cpu_tokens(tokenizer):
    engine = EngineCore(_config(), backend=CpuBackend(), tokenizer=tokenizer)
    try:
        return _greedy(engine, [tokenizer.encode(p) for p in PROMPTS])
    finally:
        engine.shutdown()


def test_greedy_output_equals_the_cpu_backends(tokenizer, cpu_tokens):
    engine = EngineCore(_config(), backend=XpuBackend(device="cpu"), tokenizer=tokenizer)
    try:
        assert _greedy(engine, [tokenizer.encode(p) for p in PROMPTS]) == cpu_tokens
    finally:
        engine.shutdown()


def test_one_completion_over_http(tokenizer, cpu_tokens):
    client = InProcessEngineClient(lambda: (EngineCore(_config(), backend=XpuBackend(device="cpu"),
                                                       tokenizer=tokenizer), tokenizer))
    client.start()
    deadline = time.monotonic() + 300
    while not client.ready:
        assert client.startup_error is None, client.startup_error
        assert time.monotonic() < deadline, "engine did not start"
        time.sleep(0.05)
    try:
        app = create_app(ServerSettings(model_id="HuggingFaceTB/SmolLM2-135M-Instruct"), client)
        reply = TestClient(app).post("/v1/completions", json={
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
            "temperature": 0.0})
    finally:
        asyncio.run(client.shutdown())
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["text"]
    assert text and tokenizer.decode(cpu_tokens[1]).startswith(text)  # the same tokens, up to an EOS
