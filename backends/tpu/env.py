"""The environment of one TPU shard process under PJRT (no torch, no torch_xla import).

These are the variables torch_xla's own multi-process start (torch_xla.launch ->
xmp.spawn -> torch_xla._internal.tpu.configure_topology) sets for one process per chip on
one host: the chip this process drives, the process grid, and the addresses and ports its
peers use. torch.distributed's rendezvous variables come from the ShardInfo, as for every
backend.
"""
from __future__ import annotations

from switchyard.core.backend import ShardInfo

TPU_PORT_BASE = 8476  # torch_xla's default first port for the per-process TPU runtime


def tpu_shard_env(shard: ShardInfo, pjrt_device: str = "TPU") -> dict[str, str]:
    """One process per chip on this host, shards in a row (process bounds world_size x 1 x 1)."""
    world = shard.world_size
    addresses = ",".join(f"localhost:{TPU_PORT_BASE + i}" for i in range(world))
    return {
        "PJRT_DEVICE": pjrt_device,
        "TPU_VISIBLE_CHIPS": str(shard.local_rank),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": f"{world},1,1",
        "TPU_PROCESS_ADDRESSES": addresses,
        "TPU_PROCESS_PORT": str(TPU_PORT_BASE + shard.local_rank),
        "CLOUD_TPU_TASK_ID": str(shard.rank),
        "PJRT_LOCAL_PROCESS_RANK": str(shard.local_rank),
        "PJRT_LOCAL_PROCESS_COUNT": str(world),
        "RANK": str(shard.rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(shard.local_rank),
        "MASTER_ADDR": shard.master_addr, "MASTER_PORT": str(shard.master_port),
    }
