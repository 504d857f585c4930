"""Reliability suite, client input: nothing a client sends gets a 500 or a framework's
plain-text error. Lone surrogates, undecodable and over-deep bodies, wrong methods,
unknown routes and chunked bodies over the limit are JSON errors in the route's dialect
naming the field; absurd sampling values are refused in both dialects; /chat_tokenize
needs the API key like /tokenize."""
from __future__ import annotations

import httpx
import pytest

from switchyard.gateway.guard import MAX_JSON_DEPTH, check_json_body

LONE = '"a\\ud800b"'  # valid JSON; the string holds a lone surrogate


def _post_raw(http: httpx.Client, path: str, body: bytes | str, **headers) -> httpx.Response:
    raw = body.encode() if isinstance(body, str) else body
    return http.post(path, content=raw, headers={"content-type": "application/json", **headers})


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, fragment: str = "") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    assert fragment in error["message"], error
    return error


def assert_tgi_error(response: httpx.Response, status: int, error_type: str, fragment: str = "") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    assert fragment in body["error"], body
    return body


SURROGATE_CASES = [
    ("/v1/chat/completions", '{"model": "default", "messages": [{"role": "user", "content": %s}]}' % LONE,
     "messages.0.content"),
    ("/v1/completions", '{"model": %s, "prompt": "hi"}' % LONE, "model"),
    ("/v1/chat/completions", '{"model": %s, "messages": [{"role": "user", "content": "hi"}]}' % LONE, "model"),
    ("/generate", '{"inputs": %s}' % LONE, "inputs"),
    ("/generate_stream", '{"inputs": "hi", "parameters": {"stop": [%s]}}' % LONE, "parameters.stop.0"),
    ("/tokenize", '{"inputs": %s}' % LONE, "inputs"),
    ("/tokenize", '{"prompt": %s}' % LONE, "prompt"),
    ("/invocations", '{"inputs": %s}' % LONE, "inputs"),
    ("/chat_tokenize", '{"model": "default", "messages": [{"role": "user", "content": %s}]}' % LONE,
     "messages.0.content"),
]


@pytest.mark.parametrize("path,body,field", SURROGATE_CASES)
def test_a_lone_surrogate_is_a_4xx_naming_the_field(http, path, body, field):
    response = _post_raw(http, path, body)
    if path.startswith("/v1/"):
        assert_openai_error(response, 400, field, "surrogate")
    else:
        assert_tgi_error(response, 422, "validation", field)


def test_a_surrogate_pair_is_a_character_and_passes(http):
    response = _post_raw(http, "/tokenize", '{"inputs": "smile \\ud83d\\ude00"}')
    assert response.status_code == 200, response.text
    assert "😀" in "".join(token["text"] for token in response.json())


@pytest.mark.parametrize("path", ["/invocations", "/tokenize", "/v1/chat/completions", "/generate"])
def test_json_nested_100k_levels_is_a_4xx_not_a_crash(http, path):
    depth = 100_000
    response = _post_raw(http, path, '{"inputs": ' + "[" * depth + "]" * depth + "}")
    if path.startswith("/v1/"):
        assert_openai_error(response, 400, "inputs.0.0.0.0.0.…", f"deeper than {MAX_JSON_DEPTH}")
    else:
        assert_tgi_error(response, 422, "validation", f"inputs.0.0.0.0.0.…: JSON nests deeper than {MAX_JSON_DEPTH}")


def test_any_content_type_is_checked(http):
    """/tokenize and /invocations parse their body as JSON whatever its declared type."""
    depth = 100_000
    response = http.post("/tokenize", content="[" * depth + "]" * depth, headers={"content-type": "text/plain"})
    assert_tgi_error(response, 422, "validation", "JSON nests deeper than")
    response = http.post("/invocations", content='{"inputs": %s}' % LONE, headers={"content-type": "text/plain"})
    assert_tgi_error(response, 422, "validation", "inputs")


def test_nesting_within_the_limit_passes_the_guard():
    nested = '{"messages": [{"content": ' + "[" * 100 + "]" * 100 + "}]}"
    assert check_json_body(nested.encode()) is None
    error = check_json_body(('{"a": {"b": [1, ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "]}}").encode())
    assert error is not None and error.param == "a.b.1.0.0.0.…"


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/tokenize"])
def test_invalid_utf8_is_a_json_error_in_the_dialect(http, path):
    response = _post_raw(http, path, b'{"inputs": "caf\xe9", "prompt": "x"}')
    if path.startswith("/v1/"):
        assert_openai_error(response, 400, None, "not valid UTF-8")
    else:
        assert_tgi_error(response, 422, "validation", "not valid UTF-8 (byte 15)")


def test_wrong_methods_and_unknown_routes_are_json_in_the_dialect(http):
    tgi = http.get("/generate")
    assert_tgi_error(tgi, 405, "method_not_allowed", "GET is not allowed on /generate")
    assert tgi.headers["allow"] == "POST"
    openai = http.delete("/v1/chat/completions")
    assert assert_openai_error(openai, 405)["code"] == "method_not_allowed"
    assert_tgi_error(http.get("/no/such/route"), 404, "not_found")
    assert_openai_error(http.post("/v1/no-such", json={}), 404)


def test_a_chunked_body_over_the_payload_limit_is_a_json_413(start_server):
    small = start_server(payload_limit=1000)

    def chunks():
        yield b'{"inputs": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    with httpx.Client(base_url=small.base_url, timeout=60) as http:
        response = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        assert_tgi_error(response, 413, "payload_too_large", "over the limit of 1000 bytes")
        openai = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert_openai_error(openai, 413, None, "limit")


def test_a_500_names_no_exception_class(http, server, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyError("secret internal detail")

    monkeypatch.setattr(server.app.state.service, "encode", boom)
    monkeypatch.setattr(server.app.state.service, "render_chat", boom)
    responses = [http.post("/generate", json={"inputs": "hi"}),
                 http.post("/v1/completions", json={"model": "default", "prompt": "hi"})]
    for response in responses:
        assert response.status_code == 500, response.text
        text = response.text
        assert "KeyError" not in text and "secret" not in text and "Traceback" not in text
    assert responses[0].json() == {"error": "internal error", "error_type": "internal"}
    assert responses[1].json()["error"]["message"] == "internal error"


# -- sampling values ---------------------------------------------------------------------
ABSURD = [
    ("temperature", 1e308, "temperature must be 0 (greedy) or in"),
    ("temperature", 1e-320, "temperature must be 0 (greedy) or in"),
    ("temperature", "Infinity", "temperature must be a finite number"),
    ("repetition_penalty", 1e308, "repetition_penalty must be at most"),
    ("repetition_penalty", "Infinity", "repetition_penalty must be a finite number"),
    ("top_p", "NaN", "top_p"),
    ("frequency_penalty", "-Infinity", "frequency_penalty"),
]


def _with_value(template: str, name: str, value) -> bytes:
    literal = value if isinstance(value, str) else repr(value)  # NaN/Infinity: Python's JSON extension
    return template.replace("VALUE", f'"{name}": {literal}').encode()


@pytest.mark.parametrize("name,value,fragment", ABSURD)
def test_absurd_sampling_values_are_refused_in_both_dialects(http, name, value, fragment):
    tgi = _post_raw(http, "/generate", _with_value('{"inputs": "hi", "parameters": {VALUE, "do_sample": true}}',
                                                  name, value))
    assert_tgi_error(tgi, 422, "validation", name)
    openai = _post_raw(http, "/v1/completions", _with_value('{"model": "default", "prompt": "hi", VALUE}', name, value))
    assert_openai_error(openai, 400, name, name)
    chat = _post_raw(http, "/v1/chat/completions", _with_value(
        '{"model": "default", "messages": [{"role": "user", "content": "hi"}], "stream": true, VALUE}', name, value))
    assert_openai_error(chat, 400, name)


def test_non_finite_logit_bias_is_refused(http):
    body = b'{"model": "default", "prompt": "hi", "logit_bias": {"42": NaN}}'
    assert_openai_error(_post_raw(http, "/v1/completions", body), 400, "logit_bias")


def test_a_tiny_but_sane_temperature_still_generates(http):
    response = http.post("/v1/completions", json={"model": "default", "prompt": "The sky is", "max_tokens": 3,
                                                   "temperature": 1e-3})
    assert response.status_code == 200 and response.json()["choices"][0]["text"]


# -- the API key -------------------------------------------------------------------------
def test_chat_tokenize_requires_the_api_key_and_open_routes_stay_open(start_server):
    keyed = start_server(api_key="sekret")
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=keyed.base_url, timeout=60) as http:
        assert http.post("/chat_tokenize", json=chat).status_code == 401
        assert http.post("/tokenize", json={"inputs": "hi"}).status_code == 401
        authorized = http.post("/chat_tokenize", json=chat, headers={"authorization": "Bearer sekret"})
        assert authorized.status_code == 200 and authorized.json()["tokenize_response"]
        for path in ("/health", "/ping", "/metrics", "/info", "/version", "/openapi.json"):
            assert http.get(path).status_code == 200, path


# -- start-up flags ----------------------------------------------------------------------
def test_max_batch_total_tokens_below_max_total_tokens_is_refused_at_start():
    from switchyard.core.params import ValidationError
    from switchyard.gateway.cli import build_parser
    from switchyard.gateway.serve import engine_config

    parse = build_parser(environ={}).parse_args
    with pytest.raises(ValidationError, match=r"--max-batch-total-tokens \(512\) must be at least --max-total-tokens"):
        engine_config(parse(["serve", "--max-batch-total-tokens", "512", "--max-total-tokens", "1024"]))
    config = engine_config(parse(["serve", "--max-batch-total-tokens", "1024", "--max-total-tokens", "1024"]))
    assert config.cache.num_blocks == 1024 // 16 + 1


def test_an_echoed_lone_surrogate_is_escaped_not_a_crash():
    import json

    from switchyard.gateway.errors import SafeJSONResponse

    body = SafeJSONResponse({"error": "The model `a\ud800` does not exist", "n": float("nan")}, 404).body
    assert json.loads(body) == {"error": "The model `a\ud800` does not exist", "n": -9999.0}
    assert b"\\ud800" in body


def test_the_guard_s_errors_carry_cors_headers():
    from fastapi.testclient import TestClient

    from switchyard.gateway.app import create_app
    from switchyard.gateway.settings import ServerSettings
    from test_serve import _LoadingClient

    app = create_app(ServerSettings(model_id="m", payload_limit=100, cors_allow_origin=("http://a",)), _LoadingClient())
    response = TestClient(app).post("/generate", content=b"x" * 200, headers={"origin": "http://a"})
    assert response.status_code == 413 and response.headers["access-control-allow-origin"] == "http://a"
