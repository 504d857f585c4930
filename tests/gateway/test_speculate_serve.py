"""`switchyard serve --speculate N` as a user runs it: TGI's surface (/info's `speculate`, one
`details.tokens` entry per generated token, the same tokens as a server without speculation),
OpenAI's `n`, the speculation metrics, and a model in two shards verifying proposals (against the
same two shards without speculation: shards sum their partial products in another order than
one process, and a random toy model is full of near-ties)."""
from __future__ import annotations

import httpx
import pytest

from test_serve import _start, _wait_healthy

pytestmark = pytest.mark.slow

CODE = "def area(width, height):\n    result = width * height\n    return result\n"
PROMPT = f"Rewrite this code with the variable `result` renamed to `total`:\n\n{CODE}"


def _serving(*flags):
    proc, url = _start("--max-batch-total-tokens", "4096", *flags)
    _wait_healthy(proc, url, timeout=600)
    return proc, url


def _stop(proc):
    proc.terminate()
    proc.wait(60)


def _answers(url: str) -> tuple[dict, dict]:
    generate = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 48, "details": True, "decoder_input_details": False}}, timeout=120).json()
    chat = httpx.post(url + "/v1/chat/completions", json={
        "model": "tgi", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48, "n": 2,
        "temperature": 0}, timeout=120).json()
    return generate, chat


def test_tgi_and_openai_answers_with_speculation_are_those_without():
    plain, plain_url = _serving()
    try:
        expected_generate, expected_chat = _answers(plain_url)
    finally:
        _stop(plain)
    proc, url = _serving("--speculate", "4")
    try:
        assert httpx.get(url + "/info", timeout=30).json()["speculate"] == 4
        generate, chat = _answers(url)
        details = generate["details"]
        assert len(details["tokens"]) == details["generated_tokens"]  # one entry per token, as without
        assert [t["id"] for t in details["tokens"]] == [t["id"] for t in expected_generate["details"]["tokens"]]
        assert generate["generated_text"] == expected_generate["generated_text"]
        texts = [c["message"]["content"] for c in chat["choices"]]
        assert texts == [c["message"]["content"] for c in expected_chat["choices"]] and texts[0] == texts[1]
        metrics = httpx.get(url + "/metrics", timeout=30).text
        proposed = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("switchyard_spec_proposed_tokens "))
        assert proposed > 0
    finally:
        _stop(proc)


def test_a_model_in_two_shards_verifies_proposals_with_the_tokens_of_plain_decoding():
    tiny = ("--model-id", "llama-tiny", "--load-format", "dummy", "--num-shard", "2")
    body = {"prompt": "1 2 3 1 2 3 1 2 3 1 2 3", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    one, one_url = _serving(*tiny)
    try:
        expected = httpx.post(one_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    finally:
        _stop(one)
    two, two_url = _serving(*tiny, "--speculate", "3")
    try:
        got = httpx.post(two_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        assert got == expected
        metrics = httpx.get(two_url + "/metrics", timeout=30).text
        assert any(line.startswith("switchyard_spec_proposed_tokens ") and float(line.split()[-1]) > 0
                   for line in metrics.splitlines())
    finally:
        _stop(two)
