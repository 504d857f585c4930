"""Shards on Intel GPUs: one process per XPU, collectives on torch.distributed's oneCCL
backend ("xccl", built into XPU builds of torch >= 2.8), gloo when the backend runs on the
host CPU (no oneCCL bindings exist for it on the package registry).

Each shard drives XPU shard.local_rank among the visible ones (ZE_AFFINITY_MASK, read by
Level Zero itself, is inherited, like CUDA_VISIBLE_DEVICES on GPUs) and is told its place
on the node through oneCCL's own variables, CCL_LOCAL_RANK / CCL_LOCAL_SIZE.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from switchyard.core.backend import ShardGroup, ShardInfo, ShardLauncher
from switchyard.core.shards.group import ProcessShardLauncher

XCCL = "xccl"
GLOO = "gloo"


def process_group_backend(device_type: str) -> str:
    """torch.distributed's backend for shards on this device type."""
    return XCCL if device_type == "xpu" else GLOO


def shard_env(shard: ShardInfo) -> dict[str, str]:
    """oneCCL's placement variables for one shard process, set before torch touches the
    device (core's launcher sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_*)."""
    return {"CCL_LOCAL_RANK": str(shard.local_rank), "CCL_LOCAL_SIZE": str(shard.local_world_size)}


class XpuShardLauncher:
    """The core process launcher, after a device check, with each shard's oneCCL placement.

    device_count: how many devices shards may use (torch.xpu.device_count on XPU; None on
    the host CPU, where shards share it); base: the launcher that spawns the processes
    (default: core's ProcessShardLauncher, setting shard_env in each process before its
    interpreter starts)."""

    def __init__(self, device_count: Callable[[], int] | None, base: ShardLauncher | None = None):
        self._device_count = device_count
        self._base = base or ProcessShardLauncher(env_for=shard_env)

    def start(self, shards: Sequence[ShardInfo], target: Callable[..., None], args: tuple = ()) -> ShardGroup:
        local_size = max((s.local_world_size for s in shards), default=0)
        if self._device_count is not None:
            count = self._device_count()
            if local_size > count:
                mask = os.environ.get("ZE_AFFINITY_MASK")
                where = f" (ZE_AFFINITY_MASK={mask})" if mask is not None else ""
                raise ValueError(f"--num-shard {local_size} needs {local_size} XPUs on this node, but "
                                 f"{count} {'is' if count == 1 else 'are'} visible{where}")
        return self._base.start(shards, target, args)
