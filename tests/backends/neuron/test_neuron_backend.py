"""The Neuron backend with its machine faked (the registry's Neuron SDK is placeholders):
probe verdicts, the compile cache location, the launcher's per-shard environment, and the
static shape buckets it shares with tpu. No torch_xla needed: runs in the main environment."""
from __future__ import annotations

import os

import pytest

from switchyard.backends.neuron import NeuronBackend
from switchyard.backends.neuron.device import DEFAULT_COMPILE_CACHE, NeuronHost
from switchyard.backends.neuron.env import compile_cache_url, neuron_shard_env, visible_cores
from switchyard.backends.tpu.buckets import ShapeBuckets
from switchyard.core.shards.group import ProcessShardLauncher
from switchyard.core.backend import ShardInfo
from switchyard.core.config import EngineConfig
from switchyard.core.plugins import discover_backends


class FakeHost(NeuronHost):
    def __init__(self, devices=("/dev/neuron0",), import_error=None, compiler="/opt/aws/bin/neuronx-cc"):
        self._devices, self._error, self._compiler = list(devices), import_error, compiler
        self.imports = 0

    def devices(self):
        return self._devices

    def torch_neuronx_error(self):
        self.imports += 1
        return self._error

    def compiler(self):
        return self._compiler


def test_probe_is_usable_with_devices_torch_neuronx_and_compiler():
    result = NeuronBackend.probe_host(FakeHost())
    assert result.usable and "1 Neuron device" in result.reason and "neuronx-cc" in result.reason


@pytest.mark.parametrize("host, expected", [
    (FakeHost(devices=()), "no /dev/neuron* device"),
    (FakeHost(import_error="torch_neuronx not importable: ImportError: WRONG PACKAGE"), "WRONG PACKAGE"),
    (FakeHost(compiler=None), "neuronx-cc compiler not on PATH"),
])
def test_probe_says_what_is_missing(host, expected):
    result = NeuronBackend.probe_host(host)
    assert not result.usable and expected in result.reason


def test_probe_does_not_import_torch_neuronx_without_a_device():
    host = FakeHost(devices=())
    NeuronBackend.probe_host(host)
    assert host.imports == 0


def test_the_real_probe_here_reports_why_not_and_never_raises():
    result = NeuronBackend.probe()
    assert not result.usable and result.reason


def test_compile_cache_configured_then_standard_variable_then_sdk_default():
    assert compile_cache_url("s3://bucket/cache", {"NEURON_COMPILE_CACHE_URL": "/x"}) == "s3://bucket/cache"
    assert compile_cache_url(None, {"NEURON_COMPILE_CACHE_URL": "/x"}) == "/x"
    assert compile_cache_url(None, {}) == DEFAULT_COMPILE_CACHE


def test_compile_cache_is_reported_and_given_to_the_engine_process_not_written_here(monkeypatch, tmp_path):
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    monkeypatch.setenv("SOME_USER_SETTING", "kept")
    backend = NeuronBackend(compile_cache=str(tmp_path), host=FakeHost())
    assert str(tmp_path) in backend.capabilities().attention_impl
    for runtime in ("tuned", "plain"):  # the cache is where graphs are kept, not a tuning
        wanted = backend.process_environment(EngineConfig(runtime=runtime))
        assert wanted["NEURON_COMPILE_CACHE_URL"] == str(tmp_path) and wanted["SOME_USER_SETTING"] == "kept"
    monkeypatch.setattr("switchyard.backends.tpu.backend.TpuBackend.init_device", lambda self, shard=None: None)
    backend.init_device()
    assert "NEURON_COMPILE_CACHE_URL" not in os.environ  # nothing is written into a running process


def test_visible_cores_per_shard():
    shards = [ShardInfo(rank=r, world_size=4, local_rank=r) for r in range(4)]
    assert [visible_cores(s) for s in shards] == ["0", "1", "2", "3"]
    assert [visible_cores(s, 2) for s in shards[:2]] == ["0-1", "2-3"]


def test_shard_env_names_cores_cache_and_rendezvous():
    shard = ShardInfo(rank=1, world_size=2, local_rank=1, master_addr="10.0.0.2", master_port=29611)
    env = NeuronBackend(compile_cache="/cache", cores_per_shard=2, host=FakeHost()).shard_env(shard)
    assert env == neuron_shard_env(shard, "/cache", 2)
    assert env["NEURON_RT_VISIBLE_CORES"] == "2-3" and env["NEURON_COMPILE_CACHE_URL"] == "/cache"
    assert env["PJRT_DEVICE"] == "NEURON" and env["NEURON_PJRT_PROCESS_INDEX"] == "1"
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("1", "2", "10.0.0.2", "29611")


def _report_env(shard, path):
    import os
    with open(path / f"rank{shard.rank}", "w") as out:
        out.write(f"{os.environ['NEURON_RT_VISIBLE_CORES']} {os.environ['NEURON_COMPILE_CACHE_URL']}")


def _fail(shard):
    raise SystemExit(3)


@pytest.mark.slow
def test_launcher_starts_each_shard_process_with_its_own_cores(tmp_path):
    backend = NeuronBackend(compile_cache="/cache", host=FakeHost())
    shards = [ShardInfo(rank=r, world_size=2, local_rank=r) for r in range(2)]
    launcher = backend.shard_launcher()
    assert isinstance(launcher, ProcessShardLauncher)
    group = launcher.start(shards, _report_env, (tmp_path,))
    assert group.wait(60)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["0 /cache", "1 /cache"]
    assert "NEURON_RT_VISIBLE_CORES" not in __import__("os").environ  # the parent's env is restored
    group.stop()


@pytest.mark.slow
def test_launcher_reports_a_shard_that_ended():
    group = NeuronBackend(host=FakeHost()).shard_launcher().start([ShardInfo(rank=0, world_size=1)], _fail)
    assert group.wait(60)
    assert group.failure().startswith("Shard 0 terminated") and "3" in group.failure()
    group.stop()


def test_buckets_pad_to_the_smallest_fit_and_bound_the_shapes():
    buckets = ShapeBuckets.for_limits(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=100, block_size=16)
    assert buckets.tokens == (16, 32, 64) and buckets.requests == (1, 2, 4, 8) and buckets.max_blocks == 7
    assert [buckets.pad_tokens(n) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]
    assert [buckets.pad_requests(n) for n in (1, 3, 5, 8)] == [1, 4, 8, 8]
    with pytest.raises(ValueError):
        buckets.pad_tokens(65)
    assert len(buckets.shapes()) == 12  # every pair: even 8 requests fit in 16 tokens
    narrow = ShapeBuckets.for_limits(max_num_batched_tokens=4, max_num_seqs=8, max_model_len=8, block_size=8)
    assert narrow.tokens == (4,) and narrow.requests == (1, 2, 4)
    assert ShapeBuckets.for_limits(24, 3, 8, 8).tokens == (16, 24)  # the cap is a bucket


def test_switchyard_backends_lists_tpu_and_neuron_with_reason_and_attention_path():
    reports = {r.name: r for r in discover_backends()}
    for name in ("tpu", "neuron"):
        assert not reports[name].usable and reports[name].reason
    assert "Pallas" in reports["tpu"].attention_impl
    assert "neuronx-cc" in reports["neuron"].attention_impl
