"""`ProcessGroupShards`: the shard hooks of a backend whose shards are processes joined by
torch.distributed over the backend's declared `dist_backend` (gloo, nccl, xccl, xla): the group
joined in init_device, its collectives as the communicator, and spawned processes as the
launcher. A backend mixes it in before `Backend` (`class CpuBackend(ProcessGroupShards,
Backend)`) and may still override a hook (CUDA joins with its device, TPU starts its processes
with each chip's environment).
"""
from __future__ import annotations

from ..backend_contract import SINGLE_SHARD, Communicator, ShardInfo, ShardLauncher
from . import distributed  # looked up at call time (tests stand in for the group join)
from .group import ProcessShardLauncher


class ProcessGroupShards:
    dist_backend: str | None

    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        """No device context; joins the shard group over dist_backend when sharded."""
        if shard.sharded:
            if self.dist_backend is None:
                raise ValueError(f"backend {self.name!r} cannot shard (it declares no dist_backend)")
            distributed.init_process_group(shard, self.dist_backend)

    def communicator(self) -> Communicator | None:
        """The torch.distributed group this process joined (core/shards/distributed.py)."""
        return distributed.current_communicator()

    def shard_launcher(self) -> ShardLauncher | None:
        """Spawned processes (core/shards/group.py); None without a dist_backend."""
        return None if self.dist_backend is None else ProcessShardLauncher()
