"""LoRA adapters as the gateway serves them (gateway/lora), over a scripted engine that records
what it was asked: flags, the run-time routes and their protection and errors, selection by the
OpenAI `model`, TGI's `adapter_id` and gRPC's, and /v1/models. The engine's side (loading PEFT
files, batched deltas) is tested in tests/core/lora; a served end-to-end run is in
tests/e2e/test_lora_serve.py."""
from __future__ import annotations

import argparse
import os

import pytest
from scripted_engine import MODEL, ScriptedEngineClient, reasoning_tokenizer, scripted_app

from switchyard.core.errors import ValidationError
from switchyard.gateway.lora.adapters import LoraAdapters, LoraSettings
from switchyard.gateway.lora.flags import add_lora_flags, lora_config, parse_adapters

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
KEY = "sekrit"


class LoraEngine(ScriptedEngineClient):
    """Answers with the adapter's name; loads what exists on disk, refuses the rest as the engine would."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loaded: list[tuple[str, str]] = []
        self.unloaded: list[str] = []

    async def load_lora(self, name, path):
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"{path} has no adapter_config.json")
        self.loaded.append((name, path))

    async def unload_lora(self, name):
        self.unloaded.append(name)


def _adapter_dir(root, name):
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return reasoning_tokenizer(TEMPLATE)


def _app(tokenizer, tmp_path, *, enabled=True, start=(), allowed=(), api_key=KEY):
    engine = LoraEngine(tokenizer, lambda request: [f"[{request.lora_name or 'base'}]"])
    lora = LoraSettings(enabled, tuple(start), tuple(str(a) for a in allowed))
    return engine, scripted_app(engine, api_key=api_key, lora=lora)


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_flags_read_tgi_and_vllm_spellings(tmp_path):
    parser = argparse.ArgumentParser()
    add_lora_flags(parser, {"LORA_ADAPTERS": f"a={tmp_path}/x, {tmp_path}/y/"})
    args = parser.parse_args(["--lora-modules", f"c={tmp_path}/z", "--max-loras", "3"])
    config = lora_config(args)
    assert config.adapters == (("a", f"{tmp_path}/x"), ("y", f"{tmp_path}/y"), ("c", f"{tmp_path}/z"))
    assert config.enabled and config.max_loras == 3 and not config.enable
    with pytest.raises(ValidationError, match="two LoRA adapters"):
        parse_adapters(["a=/x", "a=/y"])
    with pytest.raises(ValidationError, match="--max-loras"):
        lora_config(parser.parse_args(["--max-loras", "0"]))
    assert not lora_config(argparse.ArgumentParser().parse_args([]) if False else
                           _parsed([])).enabled


def _parsed(argv):
    parser = argparse.ArgumentParser()
    add_lora_flags(parser, {})
    return parser.parse_args(argv)


def test_path_policy(tmp_path):
    allowed = tmp_path / "adapters"
    inside = _adapter_dir(allowed, "ok")
    outside = _adapter_dir(tmp_path, "elsewhere")
    os.symlink(outside, allowed / "sneaky")
    adapters = LoraAdapters(LoraSettings(True, (), (str(allowed),)))
    assert adapters.check_path(inside) == os.path.realpath(inside)
    for bad, why in [("relative/dir", "absolute"), ("https://hub/x", "URL"), (outside, "outside"),
                     (str(allowed / "sneaky"), "outside"), (str(allowed / "ok" / ".." / ".." / "elsewhere"), "outside"),
                     (str(allowed / "missing"), "not a directory")]:
        with pytest.raises(ValidationError, match=why):
            adapters.check_path(bad)


def test_a_llama_cpp_gguf_file_is_an_adapter_path(tmp_path):
    gguf_file, text_file = tmp_path / "sql.gguf", tmp_path / "sql.txt"
    gguf_file.write_bytes(b"GGUF")
    text_file.write_text("not an adapter")
    assert parse_adapters([str(gguf_file)]) == (("sql", str(gguf_file)),)  # named by the file, less .gguf
    adapters = LoraAdapters(LoraSettings(True, (), ()))
    assert adapters.check_path(str(gguf_file)) == os.path.realpath(gguf_file)
    with pytest.raises(ValidationError, match="not a directory \\(a PEFT adapter\\) or a .gguf file"):
        adapters.check_path(str(text_file))


def test_load_select_list_unload(tokenizer, tmp_path):
    path = _adapter_dir(tmp_path, "sql")
    engine, app = _app(tokenizer, tmp_path)
    with app as client:
        body = {"lora_name": "sql", "lora_path": path}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 401  # behind the API key
        r = client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
        assert r.status_code == 200 and "added successfully" in r.text, r.text
        assert engine.loaded == [("sql", os.path.realpath(path))]
        again = client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]

        cards = {c["id"]: c for c in client.get("/v1/models", headers=AUTH).json()["data"]}
        assert cards["sql"]["parent"] == MODEL and cards["sql"]["root"] == os.path.realpath(path)

        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        r = client.post("/v1/chat/completions", json={**chat, "model": "sql"}, headers=AUTH)
        assert r.json()["choices"][0]["message"]["content"] == "[sql]"
        assert engine.requests[-1].lora_name == "sql"
        r = client.post("/v1/chat/completions", json={**chat, "model": MODEL}, headers=AUTH)
        assert r.json()["choices"][0]["message"]["content"] == "[base]"
        r = client.post("/v1/completions", json={"prompt": "x", "model": "sql", "max_tokens": 3}, headers=AUTH)
        assert r.json()["choices"][0]["text"] == "[sql]"

        r = client.post("/generate", json={"inputs": "x", "parameters": {"adapter_id": "sql"}}, headers=AUTH)
        assert r.json()["generated_text"] == "[sql]", r.text
        r = client.post("/generate", json={"inputs": "x", "parameters": {"adapter_id": "nope"}}, headers=AUTH)
        assert r.status_code == 404 and "no LoRA adapter named 'nope'" in r.json()["error"]

        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=AUTH)
        assert r.status_code == 200 and engine.unloaded == ["sql"]
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
        assert "sql" not in {c["id"] for c in client.get("/v1/models", headers=AUTH).json()["data"]}


def test_engine_refusal_is_a_400_and_changes_nothing(tokenizer, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    engine, app = _app(tokenizer, tmp_path, allowed=(tmp_path,))
    with app as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(empty)}, headers=AUTH)
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}, headers=AUTH)
        assert r.status_code == 400 and "--lora-allowed-dir" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": str(empty)}, headers=AUTH)
        assert r.status_code == 400 and "model's own name" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "../x", "lora_path": str(empty)}, headers=AUTH)
        assert r.status_code == 400
        assert engine.loaded == [] and "x" not in {c["id"] for c in client.get("/v1/models", headers=AUTH).json()["data"]}


def test_adapters_named_at_start_and_lora_off(tokenizer, tmp_path):
    path = _adapter_dir(tmp_path, "a")
    engine, app = _app(tokenizer, tmp_path, start=(("a", path),))
    with app as client:
        r = client.post("/v1/chat/completions", json={"model": "a", "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": "hi"}]}, headers=AUTH)
        assert r.json()["choices"][0]["message"]["content"] == "[a]"
    engine, app = _app(tokenizer, tmp_path, enabled=False)
    with app as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path}, headers=AUTH)
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        r = client.post("/generate", json={"inputs": "x", "parameters": {"adapter_id": "a"}}, headers=AUTH)
        assert r.status_code == 422 and "LoRA adapters are not supported" in r.json()["error"]


def test_grpc_adapter_id_selects_the_adapter(tokenizer, tmp_path):
    from switchyard.gateway.grpc.params import adapter_service
    from switchyard.gateway.grpc.proto import generation_pb2 as pb
    from switchyard.gateway.errors import GatewayError

    path = _adapter_dir(tmp_path, "a")
    engine, app = _app(tokenizer, tmp_path, start=(("a", path),))
    with app:
        service = app.app.state.service
        assert adapter_service(pb.SingleGenerationRequest(adapter_id="a"), service).lora_name == "a"
        assert adapter_service(pb.SingleGenerationRequest(), service) is service
        with pytest.raises(GatewayError, match="no LoRA adapter"):
            adapter_service(pb.SingleGenerationRequest(adapter_id="b"), service)
