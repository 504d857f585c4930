"""TGI generation routes against the real server, driven by httpx and the real
client libraries (`text_generation` and `huggingface_hub.InferenceClient`)."""
from __future__ import annotations

import asyncio
import json

import pytest
import text_generation
from huggingface_hub import InferenceClient

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # text_generation calls .dict()

COUNT = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8,"
SKY = "Answer with one word. What color is the sky? Answer:"  # greedy ends with EOS in a few tokens


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data:"):]) for line in text.splitlines() if line.startswith("data:")]


def prompt_ids(http, inputs: str) -> list[int]:
    return [t["id"] for t in http.post("/tokenize", json={"inputs": inputs}).json()]


@pytest.fixture(scope="module")
def greedy(server):
    """The greedy answer to COUNT with details, from /generate."""
    import httpx

    r = httpx.post(server.base_url + "/generate", timeout=120,
                   json={"inputs": COUNT, "parameters": {"max_new_tokens": 6, "details": True}})
    assert r.status_code == 200, r.text
    return r


def test_generate_greedy_details_and_headers(greedy, http):
    body = greedy.json()
    details = body["details"]
    assert body["generated_text"].startswith(" 5, 6")
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 6 == len(details["tokens"])
    assert details["seed"] is None  # greedy
    assert details["prefill"] == []  # only with decoder_input_details
    assert "top_tokens" not in details and "best_of_sequences" not in details
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]
    assert all(t["logprob"] <= 0 and t["special"] is False for t in details["tokens"])
    headers = greedy.headers
    assert headers["x-compute-type"] == "cpu"
    assert float(headers["x-compute-time"]) > 0
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert int(headers[name]) >= 0, name
    assert int(headers["x-total-time"]) >= int(headers["x-inference-time"])
    assert headers["x-compute-characters"] == str(len(COUNT))
    assert headers["x-prompt-tokens"] == str(len(prompt_ids(http, COUNT)))
    assert headers["x-generated-tokens"] == "6"


def test_generate_without_details_has_no_details(http):
    r = http.post("/generate", json={"inputs": COUNT, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200
    assert set(r.json()) == {"generated_text"}


def test_stream_matches_generate(greedy, http):
    r = http.post("/generate_stream", json={"inputs": COUNT, "parameters": {"max_new_tokens": 6, "details": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-compute-characters"] == str(len(COUNT))
    assert "[DONE]" not in r.text and r.text.startswith("data:{")
    events = sse_events(r.text)
    assert [e["index"] for e in events] == list(range(1, 7))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    final = events[-1]
    body = greedy.json()
    assert final["generated_text"] == body["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert [e["token"]["id"] for e in events] == [t["id"] for t in body["details"]["tokens"]]
    assert final["details"] == {"finish_reason": "length", "generated_tokens": 6, "seed": None,
                                "input_length": len(prompt_ids(http, COUNT))}


def test_stream_without_details_ends_with_text_only(http):
    events = sse_events(http.post("/generate_stream", json={"inputs": COUNT, "parameters": {
        "max_new_tokens": 2, "top_n_tokens": 2}}).text)
    assert events[-1]["details"] is None and events[-1]["generated_text"]
    assert all(len(e["top_tokens"]) == 2 and e["top_tokens"][0]["id"] == e["token"]["id"] for e in events)


def test_compat_route_answers_a_list_or_a_stream(greedy, http):
    r = http.post("/", json={"inputs": COUNT, "parameters": {"max_new_tokens": 6}})
    assert r.status_code == 200 and isinstance(r.json(), list)
    assert r.json()[0]["generated_text"] == greedy.json()["generated_text"]
    assert int(r.headers["x-generated-tokens"]) == 6
    r = http.post("/", json={"inputs": COUNT, "parameters": {"max_new_tokens": 6}, "stream": True})
    assert sse_events(r.text)[-1]["generated_text"] == greedy.json()["generated_text"]


def test_eos_and_special_token(http):
    r = http.post("/generate", json={"inputs": SKY, "parameters": {"max_new_tokens": 16, "details": True}})
    details = r.json()["details"]
    assert details["finish_reason"] == "eos_token"
    last = details["tokens"][-1]
    assert last["special"] is True and last["text"] == "<|im_end|>"
    assert "<|im_end|>" not in r.json()["generated_text"]
    assert details["generated_tokens"] < 16


def test_stop_sequence_is_kept_like_tgi(server):
    client = text_generation.Client(server.base_url, timeout=120)
    response = client.generate(COUNT, max_new_tokens=8, stop_sequences=[" 7"])
    assert response.generated_text == " 5, 6, 7"
    assert response.details.finish_reason == text_generation.types.FinishReason.StopSequence


def test_decoder_input_details_and_top_tokens(server, http):
    client = text_generation.Client(server.base_url, timeout=120)
    response = client.generate(COUNT, max_new_tokens=3, decoder_input_details=True, top_n_tokens=3)
    ids = prompt_ids(http, COUNT)
    prefill = response.details.prefill
    assert [t.id for t in prefill] == ids
    assert prefill[0].logprob is None and all(t.logprob <= 0 for t in prefill[1:])
    assert "".join(t.text for t in prefill) == COUNT
    top = response.details.top_tokens
    assert len(top) == 3 == len(response.details.tokens)
    for token, alternatives in zip(response.details.tokens, top):
        assert len(alternatives) == 3
        assert alternatives[0].id == token.id  # greedy: the chosen token is the most likely
        assert alternatives[0].logprob == pytest.approx(token.logprob, abs=1e-4)
        assert alternatives[0].logprob >= alternatives[1].logprob >= alternatives[2].logprob


@pytest.mark.slow
def test_best_of_returns_the_most_likely_sequence(server):
    client = text_generation.Client(server.base_url, timeout=120)
    response = client.generate("Once upon a time", max_new_tokens=4, best_of=2, do_sample=True,
                               temperature=1.5)
    details = response.details
    assert len(details.best_of_sequences) == 1
    other = details.best_of_sequences[0]
    assert details.seed is not None and other.seed is not None and details.seed != other.seed
    assert sum(t.logprob for t in details.tokens) >= sum(t.logprob for t in other.tokens)
    assert other.generated_tokens == len(other.tokens) == 4


@pytest.mark.slow
def test_seed_reported_and_reproducible(http):
    params = {"max_new_tokens": 6, "do_sample": True, "temperature": 1.3, "details": True}
    first = http.post("/generate", json={"inputs": "Once upon a time", "parameters": params}).json()
    seed = first["details"]["seed"]
    assert isinstance(seed, int)
    again = http.post("/generate", json={"inputs": "Once upon a time",
                                         "parameters": {**params, "seed": seed}}).json()
    assert again["details"]["seed"] == seed
    assert again["generated_text"] == first["generated_text"]


def test_return_full_text_and_truncate(http):
    r = http.post("/generate", json={"inputs": COUNT, "parameters": {
        "max_new_tokens": 2, "return_full_text": True, "truncate": 3, "decoder_input_details": True}})
    body = r.json()
    assert body["generated_text"].startswith(COUNT) and len(body["generated_text"]) > len(COUNT)
    assert [t["id"] for t in body["details"]["prefill"]] == prompt_ids(http, COUNT)[-3:]
    assert r.headers["x-prompt-tokens"] == "3"


@pytest.mark.parametrize("extra", [{"top_p": 1.0}, {"typical_p": 1.0}, {"temperature": 0},
                                   {"temperature": 1.0, "top_p": 1.0, "typical_p": 1.0}])
def test_neutral_values_are_accepted_and_greedy(greedy, http, extra):
    """TGI answers top_p=1.0 with a 422; here it means "off", and temperature 0 means greedy."""
    r = http.post("/generate", json={"inputs": COUNT, "parameters": {"max_new_tokens": 6, **extra}})
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == greedy.json()["generated_text"]


def test_sampling_parameters_are_accepted(http):
    r = http.post("/generate", json={"inputs": COUNT, "parameters": {
        "max_new_tokens": 3, "do_sample": True, "top_k": 20, "top_p": 0.9, "typical_p": 0.95,
        "repetition_penalty": 1.2, "frequency_penalty": 0.5, "watermark": True, "seed": 7, "details": True}})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["seed"] == 7 and r.json()["details"]["generated_tokens"] == 3


def test_inference_client_text_generation(server, greedy, http):
    client = InferenceClient(base_url=server.base_url, timeout=120)
    text = client.text_generation(COUNT, max_new_tokens=6)
    assert text == greedy.json()["generated_text"]
    output = client.text_generation(COUNT, max_new_tokens=6, details=True, decoder_input_details=True)
    assert output.generated_text == text
    assert output.details.generated_tokens == 6 and output.details.finish_reason == "length"
    assert [t.id for t in output.details.prefill] == prompt_ids(http, COUNT)
    chunks = list(client.text_generation(COUNT, max_new_tokens=6, stream=True, details=True))
    assert chunks[-1].generated_text == text
    assert chunks[-1].details.generated_tokens == 6
    assert "".join(c.token.text for c in chunks) == text
    plain = list(client.text_generation(COUNT, max_new_tokens=6, stream=True))
    assert "".join(plain) == text


def test_text_generation_clients_stream(server, greedy):
    client = text_generation.Client(server.base_url, timeout=120)
    responses = list(client.generate_stream(COUNT, max_new_tokens=6))
    assert responses[-1].generated_text == greedy.json()["generated_text"]
    assert "".join(r.token.text for r in responses if not r.token.special) == greedy.json()["generated_text"]

    async def run():
        async_client = text_generation.AsyncClient(server.base_url, timeout=120)
        answer = await async_client.generate(COUNT, max_new_tokens=6)
        streamed = [r async for r in async_client.generate_stream(COUNT, max_new_tokens=6)]
        return answer, streamed

    answer, streamed = asyncio.run(run())
    assert answer.generated_text == streamed[-1].generated_text == greedy.json()["generated_text"]


@pytest.mark.slow
def test_parameters_omitted_use_tgi_defaults(start_server):
    """No `parameters`: TGI's defaults (do_sample=true, max_new_tokens = the room left)."""
    import httpx

    small = start_server(max_total_tokens=24)
    r = httpx.post(small.base_url + "/generate", json={"inputs": COUNT}, timeout=120)
    assert r.status_code == 200, r.text
    assert 0 < int(r.headers["x-generated-tokens"]) <= 24 - int(r.headers["x-prompt-tokens"])
