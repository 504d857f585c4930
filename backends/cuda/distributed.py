"""Shards on GPUs: one process per visible GPU (core's ProcessShardLauncher, after a device
count check). Collectives are core's TorchCommunicator over NCCL (RCCL on ROCm, which
torch.distributed also calls "nccl").

Each shard process sees every visible GPU (CUDA_VISIBLE_DEVICES, read by CUDA itself, is
inherited) and drives GPU shard.local_rank among them; the backend's init_device sets that
device before joining the process group.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from switchyard.core.backend import ShardInfo
from switchyard.core.shards.group import ProcessShardGroup, ProcessShardLauncher


def visible_device_ids(environ: dict[str, str] | None = None, device_count: Callable[[], int] | None = None) -> list[str]:
    """The GPUs shards may use, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs), else 0..count-1."""
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [d.strip() for d in value.split(",") if d.strip() and d.strip() != "-1"]
    count = (device_count or torch.cuda.device_count)()
    return [str(i) for i in range(count)]


class GpuShardLauncher(ProcessShardLauncher):
    """One process per GPU (`--num-shard N`): refuses shards whose local rank has no visible
    GPU (this node's shards count the engine's rank 0, which the engine runs itself)."""

    def __init__(self, device_ids: Callable[[], list[str]] | None = None):
        super().__init__()
        self._device_ids = device_ids or visible_device_ids

    def start(self, shards: Sequence[ShardInfo], target: Callable[..., None], args: tuple = ()) -> ProcessShardGroup:
        devices = self._device_ids()
        needed = max((s.local_world_size for s in shards), default=0)
        if needed > len(devices):
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
            raise ValueError(f"--num-shard {needed} needs {needed} GPUs, but {len(devices)} "
                             f"{'is' if len(devices) == 1 else 'are'} visible{where}")
        return super().start(shards, target, args)
