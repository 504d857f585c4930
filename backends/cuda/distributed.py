"""Tensor-parallel plumbing for GPUs: an NCCL communicator (RCCL on ROCm, same backend
name) and a launcher that starts one process per GPU.

Each shard process sees every visible GPU (CUDA_VISIBLE_DEVICES, read by CUDA itself,
is inherited) and uses device LOCAL_RANK among them; the backend's init_device sets
that device before joining the process group.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from switchyard.backends.cpu.distributed import GlooCommunicator, MultiprocessLauncher


class NcclCommunicator(GlooCommunicator):
    """The same collectives over a process group whose backend is nccl: tensors live on
    this shard's GPU and the collectives run on its current stream."""


def visible_device_ids(environ: dict[str, str] | None = None, device_count: Callable[[], int] | None = None) -> list[str]:
    """The GPUs shards may use, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs), else 0..count-1."""
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [d.strip() for d in value.split(",") if d.strip() and d.strip() != "-1"]
    count = (device_count or torch.cuda.device_count)()
    return [str(i) for i in range(count)]


def local_rank(environ: dict[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    return int(environ.get("LOCAL_RANK", "0"))


class GpuShardLauncher(MultiprocessLauncher):
    """One process per GPU (`--num-shard N`): checks that N GPUs are visible, then spawns
    N processes with MASTER_ADDR/MASTER_PORT, RANK, LOCAL_RANK and WORLD_SIZE set (see
    MultiprocessLauncher); shard i drives visible GPU i."""

    def __init__(self, host: str = "127.0.0.1", device_ids: Callable[[], list[str]] | None = None):
        super().__init__(host)
        self._device_ids = device_ids or visible_device_ids

    def launch(self, world_size: int, target, args: tuple = ()) -> None:
        devices = self._device_ids()
        if world_size < 1:
            raise ValueError(f"--num-shard must be at least 1, got {world_size}")
        if world_size > len(devices):
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
            raise ValueError(f"--num-shard {world_size} needs {world_size} GPUs, but {len(devices)} "
                             f"{'is' if len(devices) == 1 else 'are'} visible{where}")
        super().launch(world_size, target, args)


def init_nccl_process_group(rank: int, world_size: int, device: torch.device) -> None:
    """Joins the NCCL group described by MASTER_ADDR/MASTER_PORT; the device must be set first."""
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
