"""Neuron's per-process configuration: compile cache and cores per shard (no torch import)."""
from __future__ import annotations

from collections.abc import Mapping

from switchyard.core.backend import ShardInfo

from .device import DEFAULT_COMPILE_CACHE

COMPILE_CACHE_VAR = "NEURON_COMPILE_CACHE_URL"


def compile_cache_url(configured: str | None, environ: Mapping[str, str]) -> str:
    """Where compiled graphs persist: the configured location, else the one the standard
    NEURON_COMPILE_CACHE_URL already names, else the SDK's default. A local path or s3:// URL."""
    return configured or environ.get(COMPILE_CACHE_VAR) or DEFAULT_COMPILE_CACHE


def visible_cores(shard: ShardInfo, cores_per_shard: int = 1) -> str:
    """The NeuronCores of one shard: a contiguous range by local rank ("2" or "4-7")."""
    first = shard.local_rank * cores_per_shard
    last = first + cores_per_shard - 1
    return str(first) if first == last else f"{first}-{last}"


def neuron_shard_env(shard: ShardInfo, cache_url: str, cores_per_shard: int = 1) -> dict[str, str]:
    """One process per shard on its own cores, PJRT on Neuron, the shared compile cache and
    torch.distributed's rendezvous."""
    return {
        "PJRT_DEVICE": "NEURON",
        "NEURON_RT_VISIBLE_CORES": visible_cores(shard, cores_per_shard),
        "NEURON_RT_NUM_CORES": str(cores_per_shard),
        COMPILE_CACHE_VAR: cache_url,
        "NEURON_PJRT_PROCESS_INDEX": str(shard.rank),
        "NEURON_PJRT_PROCESSES_NUM_DEVICES": ",".join([str(cores_per_shard)] * shard.world_size),
        "RANK": str(shard.rank), "WORLD_SIZE": str(shard.world_size), "LOCAL_RANK": str(shard.local_rank),
        "MASTER_ADDR": shard.master_addr, "MASTER_PORT": str(shard.master_port),
    }
