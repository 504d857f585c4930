"""PJRT's multi-process start: one process per shard, each with its chip and process grid
in its environment before torch_xla starts. Run here with PJRT_DEVICE=CPU in place of TPU:
each process gets an XLA device of its own (collectives across PJRT-CPU processes do not
work in torch-xla 2.9, see ../shared/reference/accelerators_on_cpu.md §B4)."""
from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip("torch_xla")

from switchyard.backends.tpu import TpuBackend  # noqa: E402
from switchyard.backends.tpu.env import tpu_shard_env  # noqa: E402
from switchyard.core.shards.group import ProcessShardLauncher  # noqa: E402
from switchyard.core.backend import ShardInfo  # noqa: E402


def _report_device(shard, path):
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    total = (torch.ones(3, device=torch_xla.device()) * (shard.rank + 1)).sum().item()
    (path / f"rank{shard.rank}").write_text(
        f"{xr.device_type()} chip={os.environ['TPU_VISIBLE_CHIPS']} task={os.environ['CLOUD_TPU_TASK_ID']} "
        f"bounds={os.environ['TPU_PROCESS_BOUNDS']} sum={total:g}")


def test_tpu_shard_env_is_one_chip_per_process():
    env = tpu_shard_env(ShardInfo(rank=1, world_size=4, local_rank=1, master_port=29555))
    assert env["PJRT_DEVICE"] == "TPU" and env["TPU_VISIBLE_CHIPS"] == "1"
    assert env["TPU_PROCESS_BOUNDS"] == "4,1,1" and env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
    assert env["TPU_PROCESS_ADDRESSES"].count("localhost:") == 4 and env["TPU_PROCESS_PORT"] == "8477"
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "4", "29555")
    assert TpuBackend().shard_env(ShardInfo(rank=1, world_size=4, local_rank=1, master_port=29555)) == env


@pytest.mark.slow
def test_each_shard_process_starts_its_own_pjrt_device(tmp_path):
    shards = [ShardInfo(rank=r, world_size=2, local_rank=r) for r in range(2)]
    group = ProcessShardLauncher(functools.partial(tpu_shard_env, pjrt_device="CPU")).start(
        shards, _report_device, (tmp_path,))
    try:
        assert group.wait(300)
        assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [
            "CPU chip=0 task=0 bounds=2,1,1 sum=3", "CPU chip=1 task=1 bounds=2,1,1 sum=6"]
    finally:
        group.stop()
