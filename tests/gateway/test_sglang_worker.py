"""SGLang's worker endpoints (gateway/sglang_worker.py) against the real server: SGLang's
`/generate` dialect beside TGI's on the same path, the info and load routes the SGLang
router reads, and errors in SGLang's shape."""
from __future__ import annotations

import json

COUNT = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8,"


def _events(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_generate_text_greedy(http, server):
    r = http.post("/generate", json={"text": COUNT, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                                     "rid": "abc", "log_metrics": True, "return_hidden_states": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"].startswith(" 5,")
    meta = body["meta_info"]
    assert meta["id"] == "abc"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["completion_tokens"] == 4 == len(body["output_ids"])
    assert meta["prompt_tokens"] == len(server.client.tokenizer.encode(COUNT))
    server.wait_idle()


def test_generate_same_tokens_as_tgi(http):
    sglang = http.post("/generate", json={"text": COUNT, "sampling_params": {"max_new_tokens": 6,
                                                                             "temperature": 0}}).json()
    tgi = http.post("/generate", json={"inputs": COUNT, "parameters": {"max_new_tokens": 6}}).json()
    assert sglang["text"] == tgi["generated_text"]


def test_generate_input_ids_batch(http, server):
    ids = server.client.tokenizer.encode(COUNT)
    r = http.post("/generate", json={"input_ids": [ids, ids[:3]], "sampling_params": {"max_new_tokens": 2,
                                                                                       "temperature": 0}})
    assert r.status_code == 200, r.text
    items = r.json()
    assert isinstance(items, list) and len(items) == 2
    assert [item["meta_info"]["prompt_tokens"] for item in items] == [len(ids), 3]
    server.wait_idle()


def test_generate_stop_is_trimmed_unless_no_stop_trim(http):
    base = {"text": COUNT, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "stop": " 7"}}
    trimmed = http.post("/generate", json=base).json()
    assert trimmed["text"] == " 5, 6,"
    assert trimmed["meta_info"]["finish_reason"]["type"] == "stop"
    kept = http.post("/generate", json={**base, "sampling_params": {**base["sampling_params"],
                                                                    "no_stop_trim": True}}).json()
    assert kept["text"] == " 5, 6, 7"


def test_generate_stream_is_cumulative_and_ends_with_done(http, server):
    r = http.post("/generate", json={"text": COUNT, "stream": True,
                                     "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # text so far, not deltas
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert len(chunks[-1]["output_ids"]) == 4
    server.wait_idle()


def test_generate_json_schema(http):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = http.post("/generate", json={"text": "A JSON object with a number:", "sampling_params": {
        "max_new_tokens": 30, "temperature": 0, "json_schema": json.dumps(schema)}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["text"])["n"], int)


def test_generate_errors_in_sglang_shape(http):
    cases = [({"text": COUNT, "input_ids": [1]}, "text"),
             ({"text": COUNT, "return_logprob": True}, "return_logprob"),
             ({"text": COUNT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
             ({"text": COUNT, "sampling_params": {"max_new_tokens": "x"}}, "sampling_params.max_new_tokens"),
             ({"input_ids": [10 ** 9]}, "input_ids"),
             ({"text": COUNT, "sampling_params": {"json_schema": "{nope"}}, "sampling_params.json_schema"),
             ({"text": [COUNT, COUNT], "stream": True}, "stream")]
    for body, param in cases:
        r = http.post("/generate", json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"], (body, error)


def test_tgi_bodies_keep_tgi_errors(http):
    r = http.post("/generate", json={"parameters": {"max_new_tokens": 2}})
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation"


def test_info_and_load_routes(http, server):
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert info["model_path"] == server.app.state.settings.model_id
        assert info["max_total_num_tokens"] > 0
    for path in ("/model_info", "/get_model_info"):
        assert http.get(path).json()["is_generation"] is True
    server.wait_idle()
    assert http.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert http.get("/health_generate").status_code == 200
