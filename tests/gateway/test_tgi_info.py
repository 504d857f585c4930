"""TGI's side routes: /info, GET /, /tokenize, /chat_tokenize, /metrics, /invocations."""
from __future__ import annotations

import re

import pytest

COUNT = "1, 2, 3, 4,"


def test_info(server, http):
    info = http.get("/info").json()
    engine = server.client.info
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert info["max_total_tokens"] == engine.max_model_len
    assert info["max_input_tokens"] == info["max_input_length"] == engine.max_model_len - 1
    assert info["max_concurrent_requests"] == 128
    assert (info["max_best_of"], info["max_stop_sequences"], info["max_client_batch_size"]) == (2, 4, 4)
    assert info["router"] == "text-generation-router" and info["version"]
    assert info["model_device_type"] == "cpu" and info["max_batch_total_tokens"] > 0


def test_info_reflects_settings(start_server):
    import httpx

    custom = start_server(max_total_tokens=64, max_input_tokens=40, max_concurrent_requests=3, max_best_of=1)
    info = httpx.get(custom.base_url + "/info").json()
    assert (info["max_total_tokens"], info["max_input_tokens"], info["max_concurrent_requests"],
            info["max_best_of"]) == (64, 40, 3, 1)
    r = httpx.post(custom.base_url + "/generate", json={"inputs": COUNT, "parameters": {
        "best_of": 2, "do_sample": True}})
    assert r.status_code == 422 and "`best_of` != 1 is not allowed" in r.json()["error"]


def test_root_get_is_a_health_check(http):
    r = http.get("/")
    assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize("text", ["Hello world, café!", "naïve 東京 emoji 🙂 ok", "  spaces\n\nand tabs\t."])
def test_tokenize_offsets_reproduce_the_text(server, http, text):
    tokens = http.post("/tokenize", json={"inputs": text}).json()
    assert [t["id"] for t in tokens] == server.client.tokenizer.encode(text)
    assert all(text[t["start"]:t["stop"]] == t["text"] for t in tokens)
    # Byte-level BPE may split one character over several tokens: each then spans it whole.
    covered, end = [], 0
    for t in tokens:
        assert t["start"] <= end  # no gap
        covered.append(text[end:t["stop"]])
        end = max(end, t["stop"])
    assert "".join(covered) == text


def test_tokenize_truncates_like_generate(http):
    full = http.post("/tokenize", json={"inputs": COUNT}).json()
    last = http.post("/tokenize", json={"inputs": COUNT, "parameters": {"truncate": 3}}).json()
    assert last == full[-3:]


def test_tokenize_vllm_bodies(server, http, default_tokenizer):
    tokenizer = default_tokenizer  # transformers' own, the reference
    body = http.post("/tokenize", json={"prompt": COUNT, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(COUNT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.client.info.max_model_len
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    body = http.post("/tokenize", json={"messages": messages}).json()
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tokenizer.encode(templated, add_special_tokens=False)


def test_chat_tokenize(server, http, default_tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    body = http.post("/chat_tokenize", json={"model": "tgi", "messages": messages}).json()
    tokenizer = default_tokenizer  # transformers' own, the reference
    expected = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi there"}],
                                             tokenize=False, add_generation_prompt=True)
    assert body["templated_text"] == expected
    tokens = body["tokenize_response"]
    assert [t["id"] for t in tokens] == tokenizer.encode(expected, add_special_tokens=False)
    assert "".join(t["text"] for t in tokens) == expected
    r = http.post("/chat_tokenize", json={"messages": []})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_metrics_count_tgi_requests(http):
    before = http.get("/metrics").text
    assert http.post("/generate", json={"inputs": COUNT, "parameters": {"max_new_tokens": 3}}).status_code == 200
    assert http.post("/generate", json={"inputs": COUNT, "parameters": {"top_k": -1}}).status_code == 422
    after = http.get("/metrics").text
    for name, delta in [("tgi_request_count", 2), ("tgi_request_success", 1),
                        ('tgi_request_failure{err="validation"}', 1), ("tgi_request_input_length_count", 1),
                        ("tgi_request_generated_tokens_count", 1), ("tgi_request_validation_duration_count", 1),
                        ("tgi_request_duration_count", 1), ("tgi_request_generated_tokens_sum", 3)]:
        assert _metric(after, name) - _metric(before, name) == delta, name


def test_invocations_dispatch_on_the_body(http):
    r = http.post("/invocations", json={"inputs": COUNT, "parameters": {"max_new_tokens": 6}})
    assert r.status_code == 200 and r.json()[0]["generated_text"].startswith(" 5, 6")
    r = http.post("/invocations", json={"inputs": COUNT, "parameters": {"max_new_tokens": 3}, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream") and '"generated_text":" 5,' in r.text
    r = http.post("/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert r.json()["usage"]["completion_tokens"] <= 3
    r = http.post("/invocations", json={"prompt": COUNT, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    assert r.json()["choices"][0]["text"].startswith(" 5, 6")
    r = http.post("/invocations", json={"messages": "not a list"})
    assert r.status_code == 422 and "messages" in r.json()["error"]
    r = http.post("/invocations", json={"something": "else"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
