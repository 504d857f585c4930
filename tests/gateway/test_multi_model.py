"""Several models behind one gateway (gateway/models_registry.py): the configuration and the
registry's load / unload / wait decisions with stand-in engines (fast), then `switchyard serve
--models FILE` with two models as a user runs it (/v1/models, dispatch on `model` and on the
X-Model header, a cold model loaded on first use, an unknown model's 404)."""
from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from switchyard.core.engine.client_base import EngineClient
from switchyard.core.config import EngineConfig, ModelConfig
from switchyard.core.params import ValidationError
from switchyard.gateway.cli import build_parser
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.metrics import Metrics
from switchyard.gateway.models_registry import ModelRegistry, ModelSpec, model_specs
from switchyard.gateway.settings import ServerSettings
from test_serve import _start, _wait_healthy


class StandIn(EngineClient):
    """An engine client that becomes ready when told; counts its life cycle."""

    def __init__(self, spec: ModelSpec, ready_after_s: float = 0.0):
        self.spec, self.tokenizer, self.info = spec, None, None
        self.started = self.stopped = False
        self._ready_at = None
        self._delay = ready_after_s
        self.in_flight = 0

    async def add_requests(self, requests):
        raise NotImplementedError

    def abort(self, request_id):
        pass

    async def compile_grammar(self, spec):
        pass

    def start(self):
        self.started, self._ready_at = True, time.monotonic() + self._delay

    @property
    def ready(self):
        return self.started and not self.stopped and time.monotonic() >= self._ready_at

    @property
    def num_unfinished(self):
        return self.in_flight

    async def wait_ready(self, timeout=None):
        while not self.ready:
            await asyncio.sleep(0.01)

    async def shutdown(self, timeout=10.0):
        self.stopped = True


def _registry(names, delay=0.0, **kwargs):
    made: dict[str, StandIn] = {}

    def make(spec):
        made[spec.name] = StandIn(spec, delay)
        return made[spec.name]

    specs = [ModelSpec(name, EngineConfig()) for name in names]
    registry = ModelRegistry(specs, make, ServerSettings(model_id=names[0]), Metrics(), **kwargs)
    default = make(specs[0])
    default.start()
    registry.adopt_default(default, object())
    return registry, made


def test_models_load_on_first_use_and_unknown_ones_are_openai_404s():
    registry, made = _registry(["a", "b"])
    assert registry.entry("tgi").spec.name == "a" and registry.entry(None).spec.name == "a"
    assert "b" not in made
    service = asyncio.run(registry.service("b"))
    assert made["b"].started and service.settings.model_id == "b" and service.client is made["b"]
    with pytest.raises(GatewayError) as missing:
        registry.entry("gpt-4")
    assert missing.value.openai_status == 404 and missing.value.openai_body()["error"]["code"] == "model_not_found"


def test_a_model_still_loading_past_the_wait_is_a_503_with_retry_after():
    registry, made = _registry(["a", "b"], delay=5.0, load_wait_s=0.1)
    with pytest.raises(GatewayError) as loading:
        asyncio.run(registry.service("b"))
    assert loading.value.openai_status == 503 and loading.value.headers["retry-after"]
    assert made["b"].started  # it keeps loading; a later request finds it


def test_past_max_loaded_models_an_idle_model_is_unloaded_and_a_busy_one_never():
    registry, made = _registry(["a", "b", "c"], max_loaded=2, idle_timeout_s=0.05)
    asyncio.run(registry.service("b"))
    made["b"].in_flight = 1  # b streams: it may not be unloaded
    time.sleep(0.1)
    with pytest.raises(GatewayError, match="--max-loaded-models"):
        asyncio.run(registry.service("c"))
    made["b"].in_flight = 0
    time.sleep(0.1)
    asyncio.run(registry.service("c"))
    assert made["b"].stopped and not registry.entries["b"].loaded and registry.entries["c"].loaded
    assert not made["a"].stopped  # the default model stays
    registry.idle_timeout_s = 60  # c was just used: b must wait for it to be idle
    with pytest.raises(GatewayError, match="idle"):
        asyncio.run(registry.service("b"))


def test_models_come_from_repeated_model_ids_or_a_file(tmp_path):
    parser = build_parser({})
    args = parser.parse_args(["serve", "--model-id", "/m/one", "--model-id", "/m/two/"])
    assert args.model == "/m/one" and args.extra_models == ["/m/two/"]
    specs = model_specs(args, EngineConfig(), "one")
    assert [s.name for s in specs] == ["one", "/m/two"] and specs[1].config.model.model == "/m/two/"

    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - name: small\n  - name: big\n    source: /m/big\n    dtype: bfloat16\n"
                      "    replicas: 2\n    shards: 2\n    max_batch_total_tokens: 1024\n")
    args = parser.parse_args(["serve", "--models", str(models)])
    small, big = model_specs(args, EngineConfig(), "ignored")
    assert small.name == "small" and small.config.model.model == "small" and small.replicas == 1
    assert big.config.model.model == "/m/big" and big.config.model.dtype == "bfloat16"
    assert big.replicas == 2 and big.config.parallel.tensor_parallel_size == 2 and big.config.cache.num_blocks == 65
    assert not small.config.serve_in_background and not big.config.serve_in_background
    models.write_text("- name: vlm\n  source: /m/text.gguf\n  mmproj: /m/mmproj.gguf\n- name: text\n")
    vlm, text = model_specs(parser.parse_args(["serve", "--models", str(models)]), EngineConfig(), "vlm")
    assert vlm.config.model.mmproj == "/m/mmproj.gguf" and text.config.model.mmproj is None
    with pytest.raises(ValidationError, match="entry's `mmproj` key"):  # a file's models each say their own
        model_specs(parser.parse_args(["serve", "--models", str(models), "--mmproj", "/m/mmproj.gguf"]),
                    EngineConfig(model=ModelConfig(mmproj="/m/mmproj.gguf")), "vlm")
    models.write_text("- name: x\n  mmproj: [1]\n")
    with pytest.raises(ValidationError, match="a file path"):
        model_specs(parser.parse_args(["serve", "--models", str(models)]), EngineConfig(), "x")
    models.write_text("- name: x\n- name: y\n  priority: background\n")
    x, y = model_specs(parser.parse_args(["serve", "--models", str(models)]), EngineConfig(), "x")
    assert not x.config.serve_in_background and y.config.serve_in_background
    models.write_text("- name: x\n  priority: high\n")
    with pytest.raises(ValidationError, match="priority 'high'.*normal, background"):
        model_specs(parser.parse_args(["serve", "--models", str(models)]), EngineConfig(), "x")
    models.write_text("- name: x\n  gpu: 3\n")
    with pytest.raises(ValidationError, match="unknown keys gpu"):
        model_specs(parser.parse_args(["serve", "--models", str(models)]), EngineConfig(), "x")
    with pytest.raises(ValidationError, match="not both"):
        model_specs(parser.parse_args(["serve", "--models", str(models), "--model-id", "a", "--model-id", "b"]),
                    EngineConfig(), "a")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_a_model_may_be_given_its_own_cpus_and_its_replicas_split_them(tmp_path, monkeypatch):
    """`cpus` (taskset's "0-3,6" or a list) becomes the model's EngineConfig.parallel.cpus, which
    its engine process takes as its affinity; replicas split the model's set, not the machine's."""
    from switchyard.gateway.replicas import replica_configs

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    parser, models = build_parser({}), tmp_path / "models.yaml"
    models.write_text("- name: x\n- name: y\n  cpus: 1-3,6\n  replicas: 2\n- name: z\n  cpus: [7]\n")
    x, y, z = model_specs(parser.parse_args(["serve", "--models", str(models)]), EngineConfig(), "x")
    assert x.config.parallel.cpus is None and y.config.parallel.cpus == (1, 2, 3, 6) and z.config.parallel.cpus == (7,)
    assert [c.parallel.cpus for c in replica_configs(y.config, y.replicas)] == [(1, 2), (3, 6)]
    for bad, words in (("8", "among the CPUs this server may use"), ("2-x", "not a CPU list"), ("[]", "among"),
                       ("true", "not a CPU list")):
        models.write_text(f"- name: x\n  cpus: {bad}\n")
        with pytest.raises(ValidationError, match=words):
            model_specs(parser.parse_args(["serve", "--models", str(models)]), EngineConfig(), "x")


def test_two_models_behind_one_gateway(tmp_path, default_gguf_path):
    models = tmp_path / "models.yaml"
    cpu = max(os.sched_getaffinity(0))  # smol-b's engine runs on this one alone
    models.write_text(f"- name: smol-a\n  source: {default_gguf_path}\n- name: smol-b\n  source: {default_gguf_path}\n"
                      f"  cpus: {cpu}\n")
    proc, url = _start("--max-batch-total-tokens", "1024", "--models", str(models), "--grammar-workers", "1")
    try:
        _wait_healthy(proc, url)
        listed = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in listed] == ["smol-a", "smol-b"]
        assert listed[1]["max_model_len"] is None  # not loaded yet

        chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3}
        answer = httpx.post(url + "/v1/chat/completions", json={**chat, "model": "smol-a"}, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == "smol-a"
        cold = time.monotonic()  # smol-b loads on this request, which waits for it
        answer = httpx.post(url + "/v1/chat/completions", json={**chat, "model": "smol-b"}, timeout=240)
        assert answer.status_code == 200 and answer.json()["model"] == "smol-b", answer.text
        print(f"cold model's first request: {time.monotonic() - cold:.1f} s")
        assert httpx.get(url + "/v1/models/smol-b", timeout=10).json()["max_model_len"] is not None  # loaded
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as children:
            engines = [os.sched_getaffinity(int(pid)) for pid in children.read().split()]
        assert {cpu} in engines, engines

        # TGI's routes (here its compat route, POST /): the X-Model header or ?model=, else the first model
        tgi = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
        assert httpx.post(url + "/", json=tgi, headers={"X-Model": "smol-b"}, timeout=60).status_code == 200
        assert httpx.post(url + "/?model=smol-a", json=tgi, timeout=60).status_code == 200
        assert httpx.get(url + "/info", headers={"X-Model": "smol-b"}, timeout=10).json()["model_id"] == "smol-b"
        missing = httpx.post(url + "/v1/chat/completions", json={**chat, "model": "nope"}, timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert httpx.post(url + "/", json=tgi, headers={"X-Model": "nope"}, timeout=10).status_code == 404
    finally:
        proc.terminate()
        proc.wait(60)
