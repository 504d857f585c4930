"""The XLA backend: static shape buckets compiled at warm-up, paged attention in XLA ops.

TpuBackend drives one XLA device through torch_xla (PJRT): a TPU chip, or, with
PJRT_DEVICE=CPU, the host CPU (how the tests run it). NeuronBackend (backends/neuron)
subclasses it for Neuron cores, whose runtime is torch_xla too.
"""
from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Mapping

import torch

from switchyard.core.backend import (SINGLE_SHARD, AttentionKernel, AttentionSpec, Backend, Capabilities,
                                     ProbeResult, ShardInfo)
from switchyard.core.shards.process_group import ProcessGroupShards
from switchyard.core.shards.distributed import init_process_group
from switchyard.core.shards.group import ProcessShardLauncher

from .attention import PallasAttentionKernel, XlaAttentionKernel
from .buckets import ShapeBuckets
from .env import tpu_shard_env
from .runner import StaticShapeRunner

XLA_ATTENTION_IMPL = ("XLA gather attention: static token/request buckets, block table padded to "
                      "max_model_len, masked softmax (index_copy_ KV writes)")
# Measured with torch-xla 2.9: an "xla" all_reduce between two PJRT_DEVICE=CPU processes
# returned each process's own tensor (each is a world of one to PJRT's CPU client), and one
# process's CPU devices only rendezvous as threads, which hung (../shared/reference/
# accelerators_on_cpu.md, B4). Shards would compute silently wrong logits, so they are refused.
PJRT_CPU_UNSHARDABLE = ("XLA collectives between PJRT CPU processes do not combine the shards' tensors "
                        "(torch-xla: each process is a world of one); shards run on TPU chips")
PALLAS_ATTENTION_IMPL = ("torch_xla ragged paged attention (Pallas TPU kernel) over static token/request "
                         "buckets (index_copy_ KV writes)")


def tpu_visible() -> bool:
    """A TPU VM exposes its chips as /dev/accel* (v2-v4) or /dev/vfio/<n> (v5+)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


class TpuBackend(ProcessGroupShards, Backend):
    name = "tpu"
    priority = 70
    dist_backend = "xla"  # torch_xla.distributed.xla_backend: collectives compiled into the graph
    planned_attention_impl = PALLAS_ATTENTION_IMPL

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self.compiled_shapes = 0  # bucket shapes compiled by the last warm-up
        self.warm_up_seconds = 0.0

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            if importlib.util.find_spec("torch_xla") is None:
                return ProbeResult(False, "torch_xla not installed")
        except Exception as error:
            return ProbeResult(False, f"torch_xla not importable: {error}")
        if not tpu_visible():
            return ProbeResult(False, "torch_xla installed, but no TPU chip (/dev/accel*, /dev/vfio/N)")
        return ProbeResult(True, "TPU chip found, torch_xla installed")

    # -- the device ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        if self._device is None:
            import torch_xla

            self._device = torch_xla.device()
        return self._device

    def device_kind(self) -> str:
        """PJRT's device type: "TPU", "CPU", "NEURON"..."""
        import torch_xla.runtime as xr

        return xr.device_type()

    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        """The XLA device of this process (its chip: tpu_shard_env), and when sharded the shard
        group as every backend joins it (core/shards/distributed.py): the data group over "xla" and the
        gloo control group that carries each step."""
        if shard.sharded:
            import torch_xla.distributed.xla_backend  # noqa: F401  registers "xla" with torch.distributed

            init_process_group(shard, self.dist_backend)
        _ = self.device

    def capabilities(self) -> Capabilities:
        on_tpu = tpu_visible()
        return Capabilities(dtypes=("float32", "bfloat16"), block_sizes=(8, 16, 32, 64, 128),
                            mixed_prefill_decode=True, prefix_caching=True, partial_prefix_hits=False,
                            graph_mode=True,
                            static_shapes=True, attention_impl=PALLAS_ATTENTION_IMPL if on_tpu else XLA_ATTENTION_IMPL,
                            unshardable_reason="" if on_tpu else PJRT_CPU_UNSHARDABLE,
                            pooling=False)  # its static-shape runner hands back logits only (runner.py)

    def available_memory_bytes(self) -> int:
        if self.device_kind() == "CPU":
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(self.device)
        return int(info["bytes_limit"]) - int(info["bytes_used"])

    # -- kernels, cache, runner ------------------------------------------------------------
    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        if self.device_kind() == "TPU":
            return PallasAttentionKernel(spec)
        return XlaAttentionKernel(spec)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, spec: AttentionSpec) -> list[torch.Tensor]:
        """Zeros made on the host and moved as device data, so that the first step's graph
        is the same as every later one's (a lazy zeros would be part of the first graph)."""
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        return [torch.zeros(shape, dtype=spec.dtype).to(self.device) for _ in range(num_layers)]

    def make_runner(self, loaded, kv_caches, config) -> StaticShapeRunner:
        """The static-shape runner, compiled for every bucket before it is returned."""
        import torch_xla

        # weights loaded or filled on the device are still pending lazy ops: materialize them
        # now, or the first warm-up graph would include them and differ from every later step's
        torch_xla.sync()
        sched = config.scheduler
        buckets = ShapeBuckets.for_limits(sched.max_num_batched_tokens, sched.max_num_seqs,
                                          loaded.max_model_len, config.cache.block_size)
        runner = StaticShapeRunner(loaded.model, self, kv_caches, config.cache.block_size, buckets, torch_xla.sync)
        self.compiled_shapes = runner.warm_up()
        self.warm_up_seconds = runner.warm_up_seconds
        return runner

    # -- shards ------------------------------------------------------------------------------
    def shard_env(self, shard: ShardInfo) -> Mapping[str, str]:
        return tpu_shard_env(shard)

    def shard_launcher(self) -> ProcessShardLauncher:
        return ProcessShardLauncher(env_for=self.shard_env)
