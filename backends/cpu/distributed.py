"""Tensor-parallel plumbing for CPU: a gloo Communicator and a multiprocess ShardLauncher."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class GlooCommunicator:
    """Collectives over an initialized torch.distributed process group (gloo on CPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("GlooCommunicator needs an initialized process group (call init_process_group)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums in place across ranks and returns the tensor."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's tensor along dim, in rank order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrites tensor in place with rank src's and returns it."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src, group=self.group)
        return tensor


def init_process_group(rank: int, world_size: int, backend: str = "gloo") -> None:
    """Joins the process group described by MASTER_ADDR/MASTER_PORT (set by the launcher)."""
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _run_shard(rank: int, world_size: int, host: str, port: int, target, args: tuple) -> None:
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        target(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class MultiprocessLauncher:
    """Spawns world_size processes running target(rank, world_size, *args) and joins them.

    Each child gets MASTER_ADDR/MASTER_PORT (a free local port chosen at launch), RANK,
    LOCAL_RANK and WORLD_SIZE in its environment; target calls init_process_group (or
    the backend's init_device) itself. target and args must be picklable (spawn).
    A failing child raises in the parent (torch.multiprocessing.ProcessRaisedException).
    """

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host

    def launch(self, world_size: int, target, args: tuple = ()) -> None:
        port = _free_port(self.host)
        mp.spawn(_run_shard, args=(world_size, self.host, port, target, tuple(args)),
                 nprocs=world_size, join=True)
