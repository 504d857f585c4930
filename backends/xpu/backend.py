"""The Intel XPU backend: IPEX paged attention (attention.py), warm-up memory sizing of the
XPU (torch.xpu behind device.py), one process per XPU over oneCCL (distributed.py).

The device is chosen at construction: "xpu" (the default) or "cpu", where the same IPEX ops
run on host tensors; the tests run it that way on machines without an Intel GPU."""
from __future__ import annotations

import logging
import os
from typing import ClassVar

import torch

from switchyard.core.backend import (SINGLE_SHARD, AttentionKernel, AttentionSpec, Backend, Capabilities,
                                     ProbeResult, ShardInfo)
from switchyard.core.shards.process_group import ProcessGroupShards
from switchyard.core.config import CacheConfig, EngineConfig

from .attention import IpexPagedAttention, StepPlanCache
from .device import XpuDevice
from .distributed import XpuShardLauncher, process_group_backend
from .ipex import ipex_status, paged_attention

logger = logging.getLogger(__name__)

ATTENTION_IMPL = ("IPEX paged attention (ipex.llm.modules.PagedAttention): reshape_and_cache for the KV "
                  "write, one single_query_cached_kv_attention call for a step's decodes, one "
                  "flash_attn_varlen_func call for its prompt chunks over the paged cache")
# Block sizes IPEX's paged kernels were checked with (tests/backends/xpu/test_ipex_attention.py).
BLOCK_SIZES = (8, 16, 32, 64, 128)


def probe_xpu(device_ops=XpuDevice, ipex_check=ipex_status) -> ProbeResult:
    """Usable when torch has XPU support, a device is visible and IPEX fits this torch;
    creates no device context, imports no IPEX, never raises."""
    try:
        problems = []
        if not device_ops.compiled():
            problems.append(f"torch {torch.__version__} is built without XPU support "
                            "(torch.xpu._is_compiled() is False; install an XPU build of torch)")
        elif not device_ops.is_available():
            mask = os.environ.get("ZE_AFFINITY_MASK")
            where = f"; ZE_AFFINITY_MASK={mask!r}" if mask is not None else ""
            problems.append(f"no XPU device visible (torch.xpu.is_available() is False{where})")
        ipex_ok, ipex_why = ipex_check()
        if problems or not ipex_ok:
            return ProbeResult(False, "; ".join([*problems, ipex_why]))
        count = device_ops.device_count()
        return ProbeResult(True, f"{count} XPU device{'s' if count != 1 else ''} visible; {ipex_why}")
    except Exception as error:
        return ProbeResult(False, f"probing XPU failed: {type(error).__name__}: {error}")


class XpuBackend(ProcessGroupShards, Backend):
    name = "xpu"
    priority = 80
    dist_backend = "xccl"  # torch.distributed's oneCCL backend on XPU; shards on the CPU device use gloo
    planned_attention_impl: ClassVar[str] = ATTENTION_IMPL

    def __init__(self, device: str = "xpu", device_ops=None):
        """device: "xpu" or "cpu" (the IPEX ops on host tensors); device_ops: the XPU calls
        (default: the real ones, device.py; tests pass a fake)."""
        if device not in ("xpu", "cpu"):
            raise ValueError(f"XpuBackend runs on 'xpu' or 'cpu', not {device!r}")
        self._device = torch.device(device, 0) if device == "xpu" else torch.device("cpu")
        self._device_ops = device_ops
        self._plans = StepPlanCache()  # one plan per step, shared by every layer's kernel
        self.memory_profile = None

    @classmethod
    def probe(cls) -> ProbeResult:
        return probe_xpu()

    @property
    def on_xpu(self) -> bool:
        return self._device.type == "xpu"

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "bfloat16", "float16"), block_sizes=BLOCK_SIZES,
                            mixed_prefill_decode=True, prefix_caching=True, graph_mode=False,
                            static_shapes=False, attention_impl=ATTENTION_IMPL,
                            multi_token_decode=True)  # a verify's tokens are decode rows (core/execution/runner.py)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def device_ops(self):
        if self._device_ops is None:
            self._device_ops = XpuDevice(self._device)
        return self._device_ops

    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        """Drives XPU shard.local_rank; joins the shard group (xccl on XPU, gloo on the CPU)."""
        if self.on_xpu:
            self._device = torch.device("xpu", shard.local_rank)
            self.device_ops.device = self._device
            self.device_ops.set_device()
        paged_attention()  # imports IPEX now (seconds), not inside the first step
        if shard.sharded:
            from switchyard.core.shards.distributed import init_process_group

            init_process_group(shard, process_group_backend(self._device.type), device=self._device)

    def available_memory_bytes(self) -> int:
        if not self.on_xpu:
            return _host_available_bytes()
        if self.memory_profile is not None:
            return self.memory_profile.available_bytes
        return self.device_ops.mem_get_info()[0]

    def profile_run(self, loaded, config: EngineConfig) -> None:
        """On an XPU, runs and measures a largest step (backends/cuda/memory.py's generic
        profile over device_ops); on the CPU device the host's free memory is the budget."""
        if not self.on_xpu:
            return
        from switchyard.backends.cuda.memory import profile_run

        self.memory_profile = profile_run(loaded.model, self, self.device_ops, loaded.attention_spec,
                                          loaded.num_layers, config.scheduler.max_num_batched_tokens,
                                          config.scheduler.max_num_seqs)

    def num_kv_blocks(self, bytes_per_block: int, cache: CacheConfig) -> int:
        """On an XPU: TGI's rule over the warm-up profile (what memory_fraction of the device
        leaves free after the weights and a largest step); on the CPU device the default."""
        if not self.on_xpu:
            return super().num_kv_blocks(bytes_per_block, cache)
        from switchyard.backends.cuda.memory import MemoryProfile, num_kv_blocks_from_profile

        profile = self.memory_profile
        if profile is None:
            free, total = self.device_ops.mem_get_info()
            profile = MemoryProfile(free, total, 0)
        return num_kv_blocks_from_profile(profile, bytes_per_block, cache)

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        if spec.block_size not in BLOCK_SIZES:
            raise ValueError(f"IPEX paged attention was not checked with block size {spec.block_size}; "
                             f"use one of {BLOCK_SIZES}")
        return IpexPagedAttention(spec, paged_attention(), self._plans)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, spec: AttentionSpec) -> list[torch.Tensor]:
        """IPEX's layout, [2, blocks, kv_heads, block_size, head_dim], seen in core's index
        order [2, blocks, block_size, kv_heads, head_dim] (attention.py)."""
        shape = (2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
        return [torch.zeros(shape, dtype=spec.dtype, device=self._device).transpose(2, 3)
                for _ in range(num_layers)]

    def shard_launcher(self) -> XpuShardLauncher:
        return XpuShardLauncher(self.device_ops.device_count if self.on_xpu else None)


def _host_available_bytes(path: str = "/proc/meminfo") -> int:
    """MemAvailable of the host (the CPU device's memory)."""
    try:
        with open(path) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
