"""`Backend`: the class every hardware plugin subclasses (registered under the entry-point
group `switchyard.backends`, found with stevedore, see plugins.py).

It is the contract of core/backend_contract.py (re-exported here, so a plugin imports
everything from this module) plus the hooks over a loaded model (prepare_model,
profile_run, make_runner), with the defaults that need no implementation: no device context,
the model as loaded, the engine's plain runner (make_runner returns None), and no shards. A
backend whose shards are processes joined by torch.distributed says so by mixing in
`ProcessGroupShards` (core/shards/process_group.py; the CPU, CUDA, XPU and TPU backends do).
This module imports no implementation (runner, shard group, launcher) and no vendor code.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backend_contract import (DEFAULT_MEMORY_FRACTION, KV_CACHE_FORMATS, KV_SCALE_BYTES, SINGLE_SHARD,
                               AttentionKernel, AttentionMetadata, AttentionSpec, BackendInterface, Capabilities, Communicator, LoraBatch,
                               LoraKernel, ProbeResult, ShardGroup, ShardInfo, ShardLauncher)
from .config import EngineConfig

if TYPE_CHECKING:
    from .execution.runner import ModelRunner
    from .loader import LoadedModel


class Backend(BackendInterface):
    """One hardware family (see BackendInterface for what each hook promises). Subclasses
    set `name` and `priority`, and implement probe, capabilities, device,
    available_memory_bytes and attention; every other hook has a default here."""

    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        """Default: no device context, and no shards (ProcessGroupShards joins a shard group)."""
        if shard.sharded:
            raise ValueError(f"backend {self.name!r} cannot shard (it has no shard hooks: see ProcessGroupShards)")

    def prepare_model(self, loaded: LoadedModel, config: EngineConfig) -> None:
        """The one place a backend may change the loaded model: swap layers for its fused
        ones, repack weights for its kernels. Called once after the weights are loaded,
        before profile_run. The default does nothing."""

    def profile_run(self, loaded: LoadedModel, config: EngineConfig) -> None:
        """Called once after prepare_model, before the KV cache is sized; measures, never
        changes the model. A device backend runs a largest-size step here, so that what its
        activations need is no longer counted as free memory. The default does nothing."""

    def make_runner(self, loaded: LoadedModel, kv_caches: list[torch.Tensor],
                    config: EngineConfig) -> ModelRunner | None:
        """The runner of every step, built once after the KV cache is allocated, or None (the
        default) for the engine's plain ModelRunner (core/execution/runner.py `runner_for`). A
        backend may return a ModelRunner subclass (graph capture, static shapes) whose execute()
        keeps the base signature and results; it must not change the model here (see
        prepare_model)."""
        return None

    def lora_kernel(self) -> LoraKernel | None:
        """The batched low-rank kernel of LoRA adapters (core/lora), where Capabilities.lora says
        the backend serves them; default none."""
        return None

    def communicator(self) -> Communicator | None:
        """Default: none (no shards)."""
        return None

    def shard_launcher(self) -> ShardLauncher | None:
        """Default: none (no shards)."""
        return None


__all__ = ["DEFAULT_MEMORY_FRACTION", "KV_CACHE_FORMATS", "KV_SCALE_BYTES", "SINGLE_SHARD", "AttentionKernel", "AttentionMetadata", "AttentionSpec",
           "Backend", "BackendInterface", "Capabilities", "Communicator", "LoraBatch", "LoraKernel", "ProbeResult", "ShardGroup", "ShardInfo",
           "ShardLauncher"]
