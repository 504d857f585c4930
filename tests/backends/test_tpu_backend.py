"""The TPU backend's decisions that need no torch_xla (runs in the main environment): shards
are refused, in one line at validation, where PJRT runs on the CPU (its collectives do not
combine separate processes' tensors), and allowed on TPU chips. Its XLA behaviour is tested
in the xla environment (tests/backends/xla)."""
from __future__ import annotations

import pytest

from switchyard.backends.tpu import TpuBackend
from switchyard.backends.tpu import backend as tpu_backend
from switchyard.core.capabilities import check_capabilities
from switchyard.core.config import EngineConfig, ModelConfig, ParallelConfig
from switchyard.core.errors import BackendCapabilityError


def _config(shards: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy"),
                        parallel=ParallelConfig(tensor_parallel_size=shards))


def test_shards_are_refused_in_one_line_where_pjrt_runs_on_the_cpu(monkeypatch):
    monkeypatch.setattr(tpu_backend, "tpu_visible", lambda: False)
    caps = TpuBackend().capabilities()
    with pytest.raises(BackendCapabilityError) as refused:
        check_capabilities("tpu", caps, _config(2))
    message = str(refused.value)
    assert message.startswith("backend 'tpu' cannot run --num-shard 2 here: XLA collectives between PJRT CPU")
    assert "\n" not in message
    assert check_capabilities("tpu", caps, _config(1)).parallel.tensor_parallel_size == 1


def test_on_tpu_chips_shards_pass_validation(monkeypatch):
    monkeypatch.setattr(tpu_backend, "tpu_visible", lambda: True)
    caps = TpuBackend().capabilities()
    assert caps.unshardable_reason == ""
    assert check_capabilities("tpu", caps, _config(4)).parallel.tensor_parallel_size == 4


def test_the_tpu_backend_uses_cores_shard_group_and_communicator():
    """No backend-specific collectives: the default communicator over the group it joined."""
    from switchyard.core.shards.process_group import ProcessGroupShards

    assert TpuBackend.communicator is ProcessGroupShards.communicator
    assert TpuBackend().communicator() is None  # not sharded in this process
