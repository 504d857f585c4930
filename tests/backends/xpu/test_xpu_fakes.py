"""The XPU backend's device-facing logic with the device faked: probe, memory sizing, device
placement and the shard launcher's checks and environment. Needs no IPEX and no XPU, so it
runs in the main environment too."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

from switchyard.backends.xpu import backend as xpu_backend
from switchyard.backends.xpu import ipex as xpu_ipex
from switchyard.backends.xpu.backend import XpuBackend, probe_xpu
from switchyard.backends.xpu.distributed import XpuShardLauncher, process_group_backend, shard_env
from switchyard.core.backend import AttentionSpec, ShardInfo
from switchyard.core.config import CacheConfig

GiB = 2**30
MiB = 2**20


@dataclass
class FakeXpu:
    """torch.xpu as device.py calls it, for a machine with `count` XPUs of `total` bytes."""

    count: int = 2
    total: int = 16 * GiB
    free: int = 12 * GiB
    built_with_xpu: bool = True
    device: torch.device | None = None
    calls: list = field(default_factory=list)

    def compiled(self) -> bool:
        return self.built_with_xpu

    def is_available(self) -> bool:
        return self.built_with_xpu and self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_device(self) -> None:
        self.calls.append(("set_device", self.device))

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, self.total


def test_probe_names_what_is_missing_without_importing_ipex():
    no_xpu_build = probe_xpu(FakeXpu(built_with_xpu=False),
                             lambda: (False, "intel-extension-for-pytorch is not installed"))
    assert not no_xpu_build.usable
    assert "built without XPU support" in no_xpu_build.reason and "not installed" in no_xpu_build.reason
    fits = lambda: (True, "intel-extension-for-pytorch 2.8.0 fits torch 2.8.0")  # noqa: E731
    no_device = probe_xpu(FakeXpu(count=0), fits)
    assert not no_device.usable and "no XPU device visible" in no_device.reason and "fits" in no_device.reason
    assert not probe_xpu(FakeXpu(count=2), lambda: (False, "needs torch 2.8.*")).usable
    ready = probe_xpu(FakeXpu(count=2), fits)
    assert ready.usable and ready.reason.startswith("2 XPU devices visible")


def test_probe_never_raises():
    class Broken(FakeXpu):
        def compiled(self) -> bool:
            raise RuntimeError("level zero exploded")

    result = probe_xpu(Broken(), lambda: (True, "fits"))
    assert not result.usable and "level zero exploded" in result.reason
    assert isinstance(XpuBackend.probe().reason, str)  # the real one, here


def test_ipex_version_must_match_torch(monkeypatch):
    monkeypatch.setattr(xpu_ipex.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(xpu_ipex.importlib.metadata, "version", lambda name: "2.8.0+cpu")
    assert xpu_ipex.ipex_problem("2.8.0+cu128") is None
    problem = xpu_ipex.ipex_problem("2.13.0")
    assert "needs torch 2.8.*" in problem and "2.13.0" in problem
    monkeypatch.setattr(xpu_ipex.importlib.util, "find_spec", lambda name: None)
    assert "not installed" in xpu_ipex.ipex_problem("2.8.0")
    with pytest.raises(ImportError, match="not installed"):
        xpu_ipex.load()


def test_init_device_drives_the_shards_local_xpu(monkeypatch):
    monkeypatch.setattr(xpu_backend, "paged_attention", lambda: None)  # IPEX's import
    fake = FakeXpu()
    backend = XpuBackend(device_ops=fake)
    backend.init_device(ShardInfo(rank=0, world_size=1, local_rank=1))
    assert backend.device == torch.device("xpu", 1)
    assert fake.calls == [("set_device", torch.device("xpu", 1))]


def test_kv_blocks_follow_the_devices_free_memory():
    fake = FakeXpu(total=16 * GiB, free=10 * GiB)
    backend = XpuBackend(device_ops=fake)
    assert backend.available_memory_bytes() == 10 * GiB
    per_block = 2 * MiB
    everything = backend.num_kv_blocks(per_block, CacheConfig(memory_fraction=1.0))
    assert everything == int(10 * GiB * 0.95) // per_block  # less the graph/fragmentation headroom
    # a fraction of 0.75 keeps a quarter of the device (4 GiB) for others: 6 GiB of 10 are left
    assert backend.num_kv_blocks(per_block, CacheConfig(memory_fraction=0.75)) == int(6 * GiB * 0.95) // per_block
    fake.free = 1 * GiB
    with pytest.raises(MemoryError, match="no device memory left"):
        backend.num_kv_blocks(per_block, CacheConfig(memory_fraction=0.5))


def test_the_cpu_device_sizes_from_host_memory():
    backend = XpuBackend(device="cpu", device_ops=FakeXpu(free=0))
    assert backend.available_memory_bytes() > 64 * MiB  # the host's, not the (faked) XPU's
    assert backend.num_kv_blocks(4096, CacheConfig(max_auto_blocks=10)) == 10


def test_kv_cache_is_ipex_layout_in_core_index_order():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, block_size=16, scale=1.0)
    cache = XpuBackend(device="cpu").allocate_kv_cache(1, 3, spec)[0]
    assert cache.shape == (2, 3, 16, 2, 8)
    assert cache.transpose(2, 3).is_contiguous()  # [2, blocks, kv_heads, block_size, head_dim] in memory


def test_process_group_backend_is_oneccl_on_xpu_and_gloo_on_cpu():
    assert XpuBackend.dist_backend == "xccl" and process_group_backend("xpu") == "xccl"
    assert process_group_backend("cpu") == "gloo"


class RecordingLauncher:
    def __init__(self):
        self.started = None

    def start(self, shards, target, args=()):
        self.started = (list(shards), target, args)
        return "group"


def _shards(n: int) -> list[ShardInfo]:
    return [ShardInfo(rank=r, world_size=n, local_rank=r, master_port=1234, local_world_size=n) for r in range(1, n)]


def test_launcher_refuses_more_shards_than_xpus(monkeypatch):
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,1")
    launcher = XpuShardLauncher(lambda: 2, base=RecordingLauncher())
    with pytest.raises(ValueError, match=r"--num-shard 3 needs 3 XPUs.*2 are visible \(ZE_AFFINITY_MASK=0,1\)"):
        launcher.start(_shards(3), print)
    assert launcher.start(_shards(2), print) == "group"
    assert XpuShardLauncher(None, base=RecordingLauncher()).start(_shards(4), print) == "group"  # CPU device


def test_each_shard_gets_its_oneccl_placement():
    shards = _shards(4)
    assert [shard_env(s) for s in shards] == [{"CCL_LOCAL_RANK": str(r), "CCL_LOCAL_SIZE": "4"} for r in (1, 2, 3)]
    base = RecordingLauncher()
    XpuShardLauncher(lambda: 4, base=base).start(shards, print, ("x",))
    assert base.started == (shards, print, ("x",))


def test_the_default_base_is_cores_process_launcher_with_the_oneccl_env():
    from switchyard.core.shards.group import ProcessShardLauncher

    base = XpuShardLauncher(None)._base
    assert isinstance(base, ProcessShardLauncher) and base.env_for is shard_env


def test_backend_launcher_checks_the_device_count_on_xpu_only():
    assert XpuBackend(device_ops=FakeXpu(count=1)).shard_launcher()._device_count() == 1
    assert XpuBackend(device="cpu").shard_launcher()._device_count is None


def test_switchyard_backends_names_the_attention_path_of_an_unusable_backend(capsys, monkeypatch):
    from switchyard.gateway import cli

    monkeypatch.setattr(XpuBackend, "probe", classmethod(lambda cls: probe_xpu(FakeXpu(count=0),
                                                                                lambda: (True, "fits"))))
    cli._cmd_backends(None)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("xpu"))
    assert "not usable: no XPU device visible" in line and "[would use: IPEX paged attention" in line
