"""llama.cpp's LoRA GGUF adapters through `switchyard serve` as users run it: the default model,
one PEFT adapter named at start twice, as its directory (b) and as the .gguf file it converts to
(a), which must give the same greedy tokens and log-probabilities, alone and sharing steps with the
base; another .gguf loaded at run time, served as its PEFT directory loaded beside it, then
unloaded; bad .gguf files refused with a 400 that names what is wrong, the server serving on.

The .gguf files are written by core/testing/lora_gguf.py in convert_lora_to_gguf.py's layout (the
converter itself is absent on CI); tests/core/lora/test_lora_gguf.py checks that writer against
the converter where it is present."""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

import httpx
import pytest

from switchyard.core.testing.lora_adapters import default_model_adapter
from switchyard.core.testing.lora_gguf import default_model_gguf_adapter
from switchyard.core.testing.serving import free_port, wait_healthy

pytestmark = pytest.mark.slow

KEY = "lora-gguf-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"


def _adapter(path, seed: int) -> str:
    """PEFT's adapter over the default model's shapes: q and k (the rows llama.cpp permutes), v and
    down of three layers, rank 8."""
    default_model_adapter(path, 8, ["q_proj", "k_proj", "v_proj", "down_proj"], seed=seed, scale=0.08,
                          layers=[0, 7, 29])
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gguf")
    peft = _adapter(root / "b", 1)
    gguf = default_model_gguf_adapter(peft, root / "a.gguf")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard.gateway.cli", "serve", "--hostname", "127.0.0.1", "--port", str(port),
         "--max-batch-total-tokens", "4096", "--api-key", KEY,
         "--lora-adapters", f"a={gguf},b={peft}", "--enable-lora", "--lora-allowed-dir", str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 300)
        yield base, root
    finally:
        proc.terminate()
        proc.wait(30)


def _greedy(base: str, model: str) -> tuple[list[str], list[float]]:
    """The greedy tokens of PROMPT under `model`, and their log-probabilities."""
    r = httpx.post(base + "/v1/completions", headers=AUTH, timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1, "ignore_eos": True})
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def _post(base: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(base + route, headers=AUTH, json=body, timeout=120)


def test_a_gguf_adapter_serves_as_its_peft_directory(served):
    base, _ = served
    alone = {name: _greedy(base, name) for name in ("default", "a", "b")}
    assert alone["a"][0] != alone["default"][0], "the adapter changes nothing: the test shows nothing"
    assert alone["a"] == alone["b"]  # the same adapter in two formats: the same tokens and log-probabilities

    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # the base and both formats sharing steps
        mixed = list(pool.map(lambda name: (name, _greedy(base, name)), ["default", "a", "b"] * 2))
    assert all(tokens == alone[name][0] for name, (tokens, _) in mixed), mixed


def test_a_gguf_adapter_loaded_at_run_time_serves_then_unloads(served):
    base, root = served
    peft = _adapter(root / "c", 2)
    gguf = default_model_gguf_adapter(peft, root / "c.gguf")
    assert httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": gguf},
                      timeout=60).status_code == 401  # behind the API key
    for name, path in (("c", gguf), ("c-peft", peft)):
        loaded = _post(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert loaded.status_code == 200, loaded.text
    assert "c" in {m["id"] for m in httpx.get(base + "/v1/models", headers=AUTH, timeout=60).json()["data"]}

    c = _greedy(base, "c")
    assert c == _greedy(base, "c-peft")
    assert c[0] not in (_greedy(base, "a")[0], _greedy(base, "default")[0])

    for name in ("c", "c-peft"):
        assert _post(base, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    gone = _post(base, "/v1/completions", {"model": "c", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404, gone.text


def test_bad_gguf_adapters_are_a_clear_400_and_the_server_serves_on(served):
    base, root = served
    before = _greedy(base, "a")
    garbage = root / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(40)))
    not_adapter = default_model_gguf_adapter(root / "b", root / "model.gguf", header={"general.type": "model"})
    cases = {str(garbage): "cannot be read as a GGUF file", not_adapter: "is not an adapter",
             str(root / "missing.gguf"): "is not a directory (a PEFT adapter) or a .gguf file"}
    for path, message in cases.items():
        refused = _post(base, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert message in error["message"] and error["param"] == "lora_path", error
    assert "bad" not in {m["id"] for m in httpx.get(base + "/v1/models", headers=AUTH, timeout=60).json()["data"]}
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    assert _greedy(base, "a") == before
