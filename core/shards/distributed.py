"""Collectives among the shards of one model, on torch.distributed (shared by every backend).

A sharded process has two groups: the default group, over the backend's `dist_backend`
("gloo", "nccl" - RCCL on ROCm - or "xccl"), carries the model's tensors with a bounded
timeout; a gloo "control" group carries the engine's small host-side messages (each step's
SchedulerOutput, the KV block count) and may wait as long as the engine is idle.
The shard processes themselves are started by core/shards/group.py.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..backend_contract import ShardInfo
from ..config import ParallelConfig

# A worker waits on the control group while the engine is idle: days, not the data timeout.
CONTROL_TIMEOUT = timedelta(days=30)

# One broadcast per step carries up to this many bytes of pickled SchedulerOutput.
OBJECT_BUFFER_BYTES = 8 << 10

_control: dist.ProcessGroup | None = None


class TorchCommunicator:
    """The Communicator of core/backend.py over an initialized process group, whatever its
    backend (tensors live on this shard's device, as that backend wants them)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs an initialized process group (init_process_group)")
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


def init_process_group(shard: ShardInfo, dist_backend: str, timeout_s: float = 300.0,
                       device: torch.device | None = None) -> None:
    """Joins the shard group at shard.master_addr:master_port (rank 0 hosts the store) and
    creates the gloo control group. A peer that does not arrive within timeout_s, or a data
    collective that waits longer, raises instead of hanging. No-op when not sharded; a
    process belongs to one shard group at a time (destroy_process_group leaves it)."""
    global _control
    if not shard.sharded:
        return
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a shard group (shut its engine down first)")
    extra = {"device_id": device} if device is not None and device.type != "cpu" else {}
    dist.init_process_group(dist_backend, init_method=f"tcp://{shard.master_addr}:{shard.master_port}",
                            rank=shard.rank, world_size=shard.world_size,
                            timeout=timedelta(seconds=timeout_s), **extra)
    _control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def destroy_process_group() -> None:
    global _control
    if dist.is_initialized():
        dist.destroy_process_group()
    _control = None


def current_communicator() -> TorchCommunicator | None:
    """The data group's communicator; None when this process is not sharded."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchCommunicator()
    return None


def control_group() -> dist.ProcessGroup:
    if _control is None:
        raise RuntimeError("this process has not joined a shard group (init_process_group)")
    return _control


def broadcast_object(obj=None, src: int = 0):
    """Rank src's picklable obj, on every rank (over the control group). One broadcast of a
    fixed 8 KiB buffer carries a typical step (a c=32 decode step pickles to ~4 KB); a
    larger object takes a second one for the rest. On a busy 2-core machine
    (benchmarks/shard_comm.py) a c=32 step took 1.0-3.0 ms this way and 3.1-10.4 ms with
    torch's broadcast_object_list (pickle, then sizes and bytes apart); a 64 KiB buffer
    was slower than either."""
    group, room = control_group(), OBJECT_BUFFER_BYTES - 8
    buffer = torch.zeros(OBJECT_BUFFER_BYTES, dtype=torch.uint8)
    payload = b""
    if dist.get_rank() == src:
        payload = pickle.dumps(obj)
        buffer[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        head = payload[:room]
        buffer[8:8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    dist.broadcast(buffer, src, group=group)
    size = int(buffer[:8].view(torch.int64).item())
    rest = torch.zeros(max(0, size - room), dtype=torch.uint8)
    if rest.numel():
        if payload:
            rest.copy_(torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8))
        dist.broadcast(rest, src, group=group)
    if payload:
        return obj
    return pickle.loads(buffer[8:8 + min(size, room)].numpy().tobytes() + rest.numpy().tobytes())


def min_across_shards(value: int) -> int:
    """The smallest of every shard's value (e.g. the KV blocks each can hold)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=control_group())
    return int(tensor.item())


@dataclass(frozen=True)
class NodePlan:
    """The shards of one node: node 0's first is rank 0 (the engine), the others are workers."""

    shards: tuple[ShardInfo, ...]

    @property
    def workers(self) -> tuple[ShardInfo, ...]:
        return tuple(s for s in self.shards if s.rank != 0)

    @property
    def engine_shard(self) -> ShardInfo | None:
        return next((s for s in self.shards if s.rank == 0), None)


def plan_node(parallel: ParallelConfig, master_port: int) -> NodePlan:
    """This node's ShardInfos: world_size = tensor_parallel_size split evenly over nnodes,
    global rank = node_rank * shards per node + local rank (torchrun's numbering)."""
    world, nnodes = parallel.tensor_parallel_size, parallel.nnodes
    if nnodes < 1 or not 0 <= parallel.node_rank < nnodes:
        raise ValueError(f"node rank {parallel.node_rank} is not in 0..{nnodes - 1} (--nnodes {nnodes})")
    if world % nnodes:
        raise ValueError(f"--num-shard {world} does not split evenly over --nnodes {nnodes}")
    per_node = world // nnodes
    return NodePlan(tuple(
        ShardInfo(rank=parallel.node_rank * per_node + local, world_size=world, local_rank=local,
                  master_addr=parallel.master_addr, master_port=master_port, local_world_size=per_node)
        for local in range(per_node)))
