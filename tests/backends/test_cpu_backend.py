"""The CPU backend's device side: capabilities, memory (its shards: tests/backends/test_distributed.py)."""
from __future__ import annotations

import os

import pytest
import torch

from switchyard.backends.cpu import CpuAttentionKernel, CpuBackend
from switchyard.backends.cpu import backend as cpu_backend_module
from switchyard.backends.cpu.backend import _meminfo_available_bytes
from switchyard.core.shards import distributed
from switchyard.core.backend import AttentionSpec, ShardInfo


def test_probe_capabilities_and_device():
    assert CpuBackend.probe().usable and CpuBackend.probe().reason == "always available"
    backend = CpuBackend()
    caps = backend.capabilities()
    assert caps.dtypes == ("float32", "bfloat16") and {8, 16, 32, 64, 128} <= set(caps.block_sizes)
    assert caps.mixed_prefill_decode and caps.prefix_caching
    assert backend.device == torch.device("cpu")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, block_size=16, scale=0.3)
    assert isinstance(backend.attention(spec), CpuAttentionKernel)
    assert [c.shape for c in backend.allocate_kv_cache(2, 5, spec)] == [(2, 5, 16, 2, 8)] * 2


def test_sharded_init_device_pins_joins_gloo_and_takes_its_share_of_memory(monkeypatch):
    seen, threads = {}, torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: seen.setdefault("cores", sorted(cores)))
    monkeypatch.setattr(distributed, "init_process_group", lambda shard, name: seen.setdefault("group", name))
    monkeypatch.setattr(cpu_backend_module, "_meminfo_available_bytes", lambda: 3000)
    backend = CpuBackend()
    try:
        CpuBackend().init_device(ShardInfo(rank=0, world_size=3, local_rank=0, local_world_size=3))
        assert seen == {"group": "gloo"} and torch.get_num_threads() == 2  # rank 0: the engine's process
        seen.clear()
        backend.init_device(ShardInfo(rank=2, world_size=3, local_rank=2, local_world_size=3))
        assert seen == {"cores": [4, 5], "group": "gloo"} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert backend.available_memory_bytes() == 1000  # the machine's memory, shared by its 3 shards


def test_available_memory(tmp_path):
    assert CpuBackend().available_memory_bytes() > 0
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    1234 kB\n")
    assert _meminfo_available_bytes(str(meminfo)) == 1234 * 1024
    assert _meminfo_available_bytes(str(tmp_path / "missing")) is None


def test_no_communicator_without_a_process_group():
    assert CpuBackend().communicator() is None
