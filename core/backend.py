"""`Backend`: the class every hardware plugin subclasses (registered under the entry-point
group `switchyard.backends`, found with stevedore, see plugins.py).

It is the contract of core/backend_contract.py (re-exported here, so a plugin imports
everything from this module) plus the hooks over a loaded model (prepare_model,
profile_run, make_runner) and the engine's default implementations of the hooks: the
plain runner, the torch.distributed shard group and spawned shard processes. The contract
imports none of these; this module imports them. Nothing here imports vendor code.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backend_contract import (DEFAULT_MEMORY_FRACTION, SINGLE_SHARD, AttentionKernel, AttentionMetadata,
                               AttentionSpec, BackendInterface, Capabilities, Communicator, ProbeResult, ShardGroup,
                               ShardInfo, ShardLauncher)
from .config import EngineConfig
from . import distributed  # looked up at call time (tests stand in for the group join)
from .runner import ModelRunner
from .shard_group import ProcessShardLauncher

if TYPE_CHECKING:
    from .loader import LoadedModel


class Backend(BackendInterface):
    """One hardware family (see BackendInterface for what each hook promises). Subclasses
    set `name` and `priority`, and implement probe, capabilities, device,
    available_memory_bytes and attention; every other hook has a default here."""

    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        """Default: no device context; joins the shard group over dist_backend when sharded."""
        if shard.sharded:
            distributed.init_process_group(shard, self._dist_backend_for_sharding())

    def prepare_model(self, loaded: LoadedModel, config: EngineConfig) -> None:
        """The one place a backend may change the loaded model: swap layers for its fused
        ones, repack weights for its kernels. Called once after the weights are loaded,
        before profile_run. The default does nothing."""

    def profile_run(self, loaded: LoadedModel, config: EngineConfig) -> None:
        """Called once after prepare_model, before the KV cache is sized; measures, never
        changes the model. A device backend runs a largest-size step here, so that what its
        activations need is no longer counted as free memory. The default does nothing."""

    def make_runner(self, loaded: LoadedModel, kv_caches: list[torch.Tensor], config: EngineConfig) -> ModelRunner:
        """The runner of every step, built once after the KV cache is allocated. A backend may
        return a ModelRunner subclass (graph capture, static shapes) whose execute() keeps the
        base signature and results; it must not change the model here (see prepare_model)."""
        return ModelRunner(loaded.model, self, kv_caches, config.cache.block_size)

    def communicator(self) -> Communicator | None:
        """Default: the torch.distributed group this process joined (core.distributed)."""
        return distributed.current_communicator()

    def shard_launcher(self) -> ShardLauncher | None:
        """Default: spawned processes (core.shard_group); None without a dist_backend."""
        if self.dist_backend is None:
            return None
        return ProcessShardLauncher()

    def _dist_backend_for_sharding(self) -> str:
        if self.dist_backend is None:
            raise ValueError(f"backend {self.name!r} cannot shard (it declares no dist_backend)")
        return self.dist_backend


__all__ = ["DEFAULT_MEMORY_FRACTION", "SINGLE_SHARD", "AttentionKernel", "AttentionMetadata", "AttentionSpec",
           "Backend", "BackendInterface", "Capabilities", "Communicator", "ProbeResult", "ShardGroup", "ShardInfo",
           "ShardLauncher"]
