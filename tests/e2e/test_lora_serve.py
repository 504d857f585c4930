"""LoRA adapters through `switchyard serve` as users run it: the default model on its default path
(the packed GGUF, default flags), one adapter made by `peft` named at start (--lora-adapters) and
another loaded at run time (--enable-lora, behind --api-key), selected by the OpenAI `model`, TGI's
`adapter_id` and gRPC's `adapter_id`, each giving the same greedy text, alone or sharing steps
with the base and the other adapter; listed in /v1/models; unloaded."""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

import httpx
import pytest

from switchyard.core.testing.lora_adapters import default_model_adapter
from switchyard.core.testing.serving import free_port, wait_healthy

pytestmark = pytest.mark.slow

KEY = "lora-key"
PROMPT = "The capital of France is"


def _adapter(path, seed: int) -> str:
    """PEFT's adapter over the default model's shapes (q, v, down of three layers, rank 8)."""
    default_model_adapter(path, 8, ["q_proj", "v_proj", "down_proj"], seed=seed, scale=0.08, layers=[0, 7, 29])
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    first, second = _adapter(root / "first", 1), _adapter(root / "second", 2)
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard.gateway.cli", "serve", "--hostname", "127.0.0.1", "--port", str(port),
         "--max-batch-total-tokens", "4096", "--api-key", KEY, "--grpc-port", str(grpc_port),
         "--lora-adapters", f"first={first}", "--enable-lora", "--lora-allowed-dir", str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 300)
        yield base, grpc_port, second
    finally:
        proc.terminate()
        proc.wait(30)


def _complete(base: str, model: str) -> str:
    r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_adapters_by_every_api_alone_and_mixed(served):
    import grpc
    from openai import OpenAI

    from switchyard.gateway.grpc.proto import generation_pb2 as pb
    from switchyard.gateway.grpc.proto import generation_pb2_grpc as pb_grpc

    base, grpc_port, second = served
    auth = {"Authorization": f"Bearer {KEY}"}
    client = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert "first" in cards and cards["first"].parent in cards

    alone = {name: _complete(base, name) for name in ("default", "first")}
    assert alone["first"] != alone["default"]  # the adapter changes the greedy answer

    tgi = httpx.post(base + "/generate", headers=auth, timeout=120, json={
        "inputs": PROMPT, "parameters": {"adapter_id": "first", "max_new_tokens": 12}})
    assert tgi.status_code == 200 and tgi.json()["generated_text"] == alone["first"], tgi.text
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        params = pb.Parameters(method=pb.GREEDY, stopping=pb.StoppingCriteria(max_new_tokens=12))
        reply = stub.Generate(pb.BatchedGenerationRequest(adapter_id="first", params=params,
                                                          requests=[pb.GenerationRequest(text=PROMPT)]),
                              metadata=[("authorization", f"Bearer {KEY}")], timeout=120)
    assert reply.responses[0].text == alone["first"]

    body = {"lora_name": "second", "lora_path": second}
    assert httpx.post(base + "/v1/load_lora_adapter", json=body, timeout=120).status_code == 401
    loaded = httpx.post(base + "/v1/load_lora_adapter", json=body, headers=auth, timeout=120)
    assert loaded.status_code == 200, loaded.text
    alone["second"] = _complete(base, "second")
    assert alone["second"] not in (alone["first"], alone["default"])

    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # the base and both adapters sharing steps
        mixed = list(pool.map(lambda name: (name, _complete(base, name)), ["default", "first", "second"] * 2))
    assert all(text == alone[name] for name, text in mixed), mixed

    bad = httpx.post(base + "/v1/load_lora_adapter", headers=auth, timeout=60,
                     json={"lora_name": "bad", "lora_path": "/etc"})
    assert bad.status_code == 400
    assert httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=auth,
                      timeout=60).status_code == 200
    gone = httpx.post(base + "/v1/completions", headers=auth, timeout=60,
                      json={"model": "second", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404
    assert _complete(base, "first") == alone["first"]
