"""The CPU backend's device side: capabilities, memory, gloo communicator, multiprocess launcher."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from switchyard.backends.cpu import CpuAttentionKernel, CpuBackend
from switchyard.backends.cpu.backend import _meminfo_available_bytes
from switchyard.core.backend import AttentionSpec


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


def test_available_memory(tmp_path):
    assert CpuBackend().available_memory_bytes() > 0
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    1234 kB\n")
    assert _meminfo_available_bytes(str(meminfo)) == 1234 * 1024
    assert _meminfo_available_bytes(str(tmp_path / "missing")) is None


def test_no_communicator_without_a_process_group():
    assert CpuBackend().communicator() is None


def _collectives(rank: int, world_size: int, result_dir: str) -> None:
    backend = CpuBackend()
    backend.init_device()  # joins the gloo group from the launcher's environment
    comm = backend.communicator()
    summed = comm.all_reduce(torch.tensor([rank + 1.0, 10.0]))
    gathered = comm.all_gather(torch.full((2, 1), float(rank)), dim=-1)
    broadcast = comm.broadcast(torch.tensor([100.0 + rank]), src=1)
    result = dict(summed=summed.tolist(), gathered=gathered.tolist(), broadcast=broadcast.tolist())
    (Path(result_dir) / f"{rank}.json").write_text(json.dumps(result))


def _fail(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("shard 1 failed on purpose")


def test_launcher_runs_collectives_over_gloo(tmp_path):
    CpuBackend().shard_launcher().launch(2, _collectives, (str(tmp_path),))
    for rank in range(2):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result == dict(summed=[3.0, 20.0], gathered=[[0.0, 1.0], [0.0, 1.0]], broadcast=[101.0])


def test_launcher_raises_when_a_shard_fails():
    with pytest.raises(ProcessRaisedException, match="shard 1 failed on purpose"):
        CpuBackend().shard_launcher().launch(2, _fail, ())
