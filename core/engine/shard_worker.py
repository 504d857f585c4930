"""The shards of one model, in lockstep.

Every shard (rank 0 in the engine's process, ranks 1..N-1 in worker processes) builds its
model the same way (build_shard_model). Then rank 0 broadcasts each step's SchedulerOutput
once over the gloo control group, and every shard runs it (run_shard's loop); the model's
own collectives keep them in step, and only rank 0 samples. None on the control group
tells the workers to stop.
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, replace

from ..backend import SINGLE_SHARD, Backend, ShardGroup, ShardInfo, ShardLauncher
from ..config import EXECUTOR_BACKENDS, CacheConfig, EngineConfig
from ..shards.distributed import broadcast_object, destroy_process_group, min_across_shards, plan_node
from ..errors import ShardTerminated
from ..kv.sizing import KVCacheSize, with_usable_tokens, without_bytes
from ..loader import LoadedModel, choose_model, load_model
from ..lora.manager import LoraManager
from ..lora.attach import attach_lora, find_targets, wrap_layers
from ..memory import drop_mapped_weight_pages, release_freed_memory
from ..models import check_shardable
from ..pooling.serving import serving_config
from ..execution.runner import ModelRunner, runner_for
from ..scheduling.output import SchedulerOutput

logger = logging.getLogger(__name__)

# How long a collective's failure waits for the launcher to see which shard ended.
FAILURE_GRACE_S = 5.0


def kv_bytes_per_block(loaded: LoadedModel) -> int:
    """One KV block's keys and values over every layer, in bytes (of the cache's dtype: a quantized
    one's codes and scales, AttentionSpec.cache_block_bytes)."""
    return loaded.num_layers * loaded.attention_spec.cache_block_bytes


def model_dtype_block_bytes(loaded: LoadedModel) -> int:
    """kv_bytes_per_block of the same cache in the model's dtype (--kv-cache-dtype auto)."""
    return loaded.num_layers * replace(loaded.attention_spec, kv_cache_dtype="auto").cache_block_bytes


def kv_cache_size(loaded: LoadedModel, num_blocks: int) -> KVCacheSize:
    """The allocated cache as the start line describes it: its bytes and what it stores (the
    model's dtype, or --kv-cache-dtype's format)."""
    spec = loaded.attention_spec
    stored = spec.kv_cache_dtype if spec.quantized_cache else str(spec.dtype).removeprefix("torch.")
    return KVCacheSize(num_blocks, spec.block_size, num_blocks * kv_bytes_per_block(loaded), stored)


def num_kv_blocks_for(cache: CacheConfig, loaded: LoadedModel, backend: Backend) -> int:
    """KV capacity in blocks: the configured count, else the backend's rule (Backend.num_kv_blocks)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    return backend.num_kv_blocks(kv_bytes_per_block(loaded), cache)


@dataclass(frozen=True)
class ShardModel:
    loaded: LoadedModel
    num_blocks: int  # the same on every shard: the smallest any of them can hold
    runner: ModelRunner
    config: EngineConfig  # what the engine serves the loaded model with (core/pooling/serving.py)
    lora: LoraManager | None = None  # LoRA adapters (core/lora), shared with the runner; None: off


def build_shard_model(config: EngineConfig, backend: Backend, shard: ShardInfo = SINGLE_SHARD) -> ShardModel:
    """Device, this shard's slice of the model, its KV cache and runner (every rank alike).
    Sharded, every rank takes rank 0's config, so nodes started with other flags still agree."""
    backend.init_device(shard)
    if shard.sharded:
        config = broadcast_object(config if shard.rank == 0 else None)
    loaded = load_model(config.model, backend, config.cache.block_size, shard=shard,
                        communicator=backend.communicator() if shard.sharded else None,
                        kv_cache_dtype=config.cache.kv_cache_dtype)
    config = serving_config(config, loaded, backend.name, backend.capabilities().pooling)  # a pooling model's
    if loaded.model.bidirectional_images:  # no prompt chunk ends inside an image (core/multimodal/image_rows.py)
        config = replace(config, scheduler=replace(config.scheduler, whole_images=True))
    drop_mapped_weight_pages()  # what reading read: a copied matrix's (a fused projection's) pages
    lora_targets = find_targets(loaded.model) if config.lora.enabled else None  # before prepare_model swaps layers
    backend.prepare_model(loaded, config)
    drop_mapped_weight_pages()  # what packing read of a still-mapped file (a GGUF embedding's rows) leaves RSS
    lora = None if lora_targets is None else attach_lora(loaded, backend, config, lora_targets)  # its stacks
    backend.profile_run(loaded, config)
    cache = with_usable_tokens(config.cache, config.scheduler.max_num_seqs, loaded.max_model_len,
                               model_dtype_block_bytes(loaded))
    num_blocks = num_kv_blocks_for(without_bytes(cache, 0 if lora is None else lora.nbytes), loaded, backend)
    if shard.sharded:
        num_blocks = min_across_shards(num_blocks)
    kv_caches = backend.allocate_kv_cache(loaded.num_layers, num_blocks, loaded.attention_spec)
    runner = runner_for(backend, loaded, kv_caches, config)
    if lora is not None:  # after the runner: a backend's own decode path holds the layers as they were
        wrap_layers(loaded.model, lora)
        runner.lora = lora
    return ShardModel(loaded, num_blocks, runner, config, lora)


def run_shard(shard: ShardInfo, config: EngineConfig, backend_name: str) -> None:
    """A worker process's body (the launcher's target): build, then run each step rank 0
    broadcasts until it broadcasts None."""
    from ..plugins import select_backend

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s shard {shard.rank} %(levelname)s %(message)s")
    model = build_shard_model(config, select_backend(backend_name), shard)
    release_freed_memory()  # what loading freed stays resident otherwise (core/memory.py)
    logger.info("shard %d of %d ready: %d KV blocks", shard.rank, shard.world_size, model.num_blocks)
    while (step := broadcast_object()) is not None:
        model.runner.copy_kv(step.kv_copies)
        model.runner.execute(step)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def shard_launcher_for(config: EngineConfig, backend: Backend) -> ShardLauncher:
    """The one place the launcher of shards 1..N-1 is chosen (ParallelConfig.executor_backend):
    the backend's own ("mp": local processes) or Ray actors on a cluster ("ray")."""
    launcher = backend.shard_launcher()
    if launcher is None:
        raise ValueError(f"backend {backend.name!r} cannot shard: it declares no dist_backend")
    executor = config.parallel.executor_backend
    if executor not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed executor backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                         f"got {executor!r}")
    if executor == "ray":
        from ..shards.ray_launcher import ray_shard_launcher

        return ray_shard_launcher(config.parallel, backend.name)
    return launcher


class ShardSet:
    """Rank 0's side of the shards: the workers this node started, the step broadcast to
    every shard, and how a shard's end becomes ShardTerminated."""

    def __init__(self, shard: ShardInfo = SINGLE_SHARD, group: ShardGroup | None = None):
        self.shard = shard
        self.group = group
        self._stopped = False

    @classmethod
    def start(cls, config: EngineConfig, backend: Backend) -> ShardSet:
        """Starts this node's worker shards (none when not sharded); returns at once."""
        parallel = config.parallel
        if not parallel.sharded:
            return cls()
        _, hf_config, _ = choose_model(config.model)  # heads that do not divide: one line, nothing started
        check_shardable(hf_config, parallel.tensor_parallel_size)
        launcher = shard_launcher_for(config, backend)
        if parallel.master_port is None and parallel.nnodes > 1:
            raise ValueError("a rendezvous across nodes needs --master-port (or MASTER_PORT)")
        port = parallel.master_port or free_port(parallel.master_addr)
        plan = plan_node(parallel, port)
        if plan.engine_shard is None:
            raise ValueError(f"node rank {parallel.node_rank} runs shards only, not the engine (run_node)")
        group = launcher.start(plan.workers, run_shard, (config, backend.name))
        logger.info("started shards %s of %d", [s.rank for s in plan.workers], parallel.tensor_parallel_size)
        return cls(plan.engine_shard, group)

    @property
    def sharded(self) -> bool:
        return self.shard.sharded

    def execute(self, runner: ModelRunner, step: SchedulerOutput):
        """Every shard runs step (its partial prefix hits' copies first); rank 0's results. A shard
        that died raises ShardTerminated."""
        if not self.sharded:
            runner.copy_kv(step.kv_copies)
            return runner.execute(step)
        self.check()  # a local shard that ended: say which, before any collective meets it
        try:
            broadcast_object(step)
            runner.copy_kv(step.kv_copies)
            return runner.execute(step)
        except RuntimeError as exc:
            raise self.terminated(exc) from exc

    def check(self) -> None:
        failure = None if self.group is None else self.group.failure()
        if failure is not None:
            raise ShardTerminated(failure)

    def terminated(self, exc: BaseException) -> ShardTerminated:
        """What a failed collective means: the shard whose end the launcher saw, else exc."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while self.group is not None and time.monotonic() < deadline:
            failure = self.group.failure()
            if failure is not None:
                return ShardTerminated(failure)
            time.sleep(0.05)
        return ShardTerminated(f"the sharded step failed (the shards are out of step): {type(exc).__name__}: {exc}")

    def shutdown(self, timeout: float = 10.0, graceful: bool = True) -> None:
        """Tells the workers to stop (every node's; not when graceful is False, e.g. while they
        may still be loading), stops this node's processes and leaves the process group (a
        later engine in this process may form a new one)."""
        if not self.sharded or self._stopped:
            return
        self._stopped = True
        if graceful and self.group.failure() is None:
            try:
                broadcast_object(None)
            except RuntimeError as exc:
                logger.warning("could not tell the shards to stop: %s", exc)
        if not self.group.wait(timeout):
            logger.warning("shards still running %.0fs after stop; terminating them", timeout)
        self.group.stop(timeout)
        destroy_process_group()


def run_node(config: EngineConfig, backend: Backend) -> int:
    """Node k > 0 of a multi-node run: starts this node's shards and waits for them (no
    HTTP, no scheduler). 0 when they stopped because the engine told them to."""
    parallel = config.parallel
    if parallel.master_port is None:
        raise ValueError("a shard-only node needs --master-port (or MASTER_PORT)")
    launcher = shard_launcher_for(config, backend)
    plan = plan_node(parallel, parallel.master_port)
    group = launcher.start(plan.shards, run_shard, (config, backend.name))
    logger.info("node %d: started shards %s", parallel.node_rank, [s.rank for s in plan.shards])
    try:
        while not group.wait(0.5):
            if (failure := group.failure()) is not None:
                logger.error("%s", failure)
                return 1
        failure = group.failure()
        if failure is not None:
            logger.error("%s", failure)
        return 0 if failure is None else 1
    finally:
        group.stop()
