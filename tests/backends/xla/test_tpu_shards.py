"""TPU shards join their group as every backend's do (core/shards/distributed.py): two PJRT_DEVICE=CPU
processes, each with its TPU process environment, through TpuBackend.init_device: the "xla"
data group, and the gloo control group that carries each step (broadcast_object) and the KV
block count (min_across_shards), with core's communicator over the data group. PJRT's CPU
client cannot combine the data group's collectives across processes (test_tpu_backend.py
refuses shards there), so only the control group's results are compared here."""
from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip("torch_xla")

from switchyard.backends.tpu import TpuBackend  # noqa: E402
from switchyard.backends.tpu.env import tpu_shard_env  # noqa: E402
from switchyard.core.backend import ShardInfo  # noqa: E402
from switchyard.core.shards.group import ProcessShardLauncher  # noqa: E402
from switchyard.core.testing.serving import free_port


def _join_and_talk(shard, path):
    from switchyard.core.shards.distributed import TorchCommunicator, broadcast_object, min_across_shards

    backend = TpuBackend()
    backend.init_device(shard)
    step = broadcast_object({"step": 7, "from": shard.rank} if shard.rank == 0 else None)
    smallest = min_across_shards(10 + shard.rank)
    communicator = backend.communicator()
    (path / f"rank{shard.rank}").write_text(
        f"{backend.device.type} step={step['step']} from={step['from']} min={smallest} "
        f"communicator={type(communicator).__name__} world={communicator.world_size}")
    assert isinstance(communicator, TorchCommunicator)


@pytest.mark.slow
def test_sharded_tpu_processes_join_the_data_and_control_groups(tmp_path):
    port = free_port()
    shards = [ShardInfo(rank=r, world_size=2, local_rank=r, master_port=port, local_world_size=2) for r in range(2)]
    group = ProcessShardLauncher(functools.partial(tpu_shard_env, pjrt_device="CPU")).start(
        shards, _join_and_talk, (tmp_path,))
    try:
        assert group.wait(300), "the shards did not finish"
        assert group.failure() is None, group.failure()
        assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [
            "xla step=7 from=0 min=10 communicator=TorchCommunicator world=2"] * 2
    finally:
        group.stop()


def test_an_engine_of_shards_on_pjrt_cpu_is_refused_before_any_shard_starts():
    from dataclasses import replace

    from xla_helpers import tiny_config

    from switchyard.core.config import ParallelConfig
    from switchyard.core.engine.core import EngineCore
    from switchyard.core.errors import BackendCapabilityError

    config = replace(tiny_config(), parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(BackendCapabilityError, match=r"^backend 'tpu' cannot run --num-shard 2 here: XLA collectives"):
        EngineCore(config, backend=TpuBackend())
