"""Runs a function in N processes joined by a torch.distributed gloo group on loopback,
each with a minimal Communicator, for the tensor-parallel model tests. (The engine's own
communicator and launcher live in core/shards/distributed.py; these tests need only the model.)"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from switchyard.core.backend import ShardInfo
from switchyard.core.testing.serving import free_port


class GlooCommunicator:
    """core.backend.Communicator over the default process group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls += 1
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.calls += 1
        dist.broadcast(tensor, src)
        return tensor


def _shard_main(rank: int, world_size: int, port: int, out_dir: str, job: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        shard = ShardInfo(rank=rank, world_size=world_size, master_port=port)
        result = job(shard, GlooCommunicator(world_size), *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_sharded(world_size: int, job: Callable[..., Any], *args: Any) -> list[Any]:
    """job(shard: ShardInfo, communicator, *args) in world_size processes (a top-level,
    importable function); returns each rank's result (anything torch.save takes), rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_shard_main, args=(world_size, free_port(), out_dir, job, args), nprocs=world_size,
                           join=True, start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False) for rank in range(world_size)]
