"""The embedded default backend: always usable, plain torch on the host CPU."""
from __future__ import annotations

import os

import logging

import torch

from switchyard.core.backend import (SINGLE_SHARD, AttentionKernel, AttentionSpec, Backend, Capabilities, ProbeResult,
                                     ShardInfo)

from .attention import CpuAttentionKernel, StepPlanCache
from .extension import PagedDecode
from .linear import pack_linears, packing_supported
from .runtime import cpu_flags, loaded_libraries, prefers_bfloat16, this_machine
from .tuning import choose_single_row_products

logger = logging.getLogger(__name__)

# The in-place kernel takes steps of at most this many decodes. Measured 2026-12-01 on an idle
# 2-core AVX2 EPYC, default model, float32, 2 threads (benchmarks/cpu_decode_step.py), in-place
# step / gather step: 0.87 at c=1, 1.08 at c=8, 1.22 at c=32: it parallelises over (request, KV
# head) only, and loses to the gather path's batched GEMMs once there are many requests.
IN_PLACE_MAX_DECODES = 4

GATHER_IMPL = ("SDPA over gathered blocks (torch scaled_dot_product_attention; decodes in groups of 16, "
               "short bf16 ones as one batched matmul; one call per prompt chunk)")


def _cache_root(cache_dir: str | None) -> str:
    """Where compiled kernels are kept: the model's cache_dir (ModelConfig), else ~/.cache/switchyard."""
    from switchyard.core.loader.gguf_cache import default_cache_root

    return cache_dir or default_cache_root()


def shard_cores(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """The cores shard local_rank of local_world_size runs on: disjoint equal slices of
    cores (the remainder left to the OS); with more shards than cores, one core each,
    round-robin, so shards share cores but each still runs one thread."""
    if local_world_size > len(cores):
        return [cores[local_rank % len(cores)]]
    per_shard = len(cores) // local_world_size
    return cores[local_rank * per_shard:(local_rank + 1) * per_shard]


def _meminfo_available_bytes(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def preferred_dtype(flags: frozenset[str] | None = None) -> str:
    """bfloat16 where this CPU multiplies it natively (AVX512-BF16 or AMX, runtime.py) and
    torch's oneDNN can use it; float32 elsewhere (bf16 emulated is slower than float32)."""
    flags = cpu_flags() if flags is None else flags
    if prefers_bfloat16(flags) and torch.backends.mkldnn.is_available() and \
            torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bfloat16"
    return "float32"


class CpuBackend(Backend):
    name = "cpu"
    priority = 0
    dist_backend = "gloo"

    def __init__(self, pack_weights: bool = True, in_place_decode: bool = True) -> None:
        self._plans = StepPlanCache()  # shared by every layer's kernel: one plan per step
        # Decode attention in place (C++, built at warm-up); in_place_decode=False forces the gather path.
        self._decode = PagedDecode(enabled=in_place_decode, max_decodes=IN_PLACE_MAX_DECODES)
        # Reorder float32/bf16 linear weights for oneDNN once, at load (see linear.py).
        self.pack_weights = pack_weights and packing_supported()
        self._local_shards = 1  # shards of one model on this machine share its memory

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "always available")

    def capabilities(self) -> Capabilities:
        # the kernel gathers whole blocks of any size; small ones serve tiny test models
        return Capabilities(dtypes=("float32", "bfloat16"), block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                            mixed_prefill_decode=True, prefix_caching=True, graph_mode=False,
                            static_shapes=False, attention_impl=self.attention_impl(),
                            preferred_dtype=preferred_dtype(), runtime=this_machine().describe())

    def process_environment(self, config) -> dict[str, str]:
        """The tuned runtime of runtime.py (allocator, Intel OpenMP, threads, binding when the
        engine process is the model's only process), merged with the user's environment."""
        if config.runtime == "plain":
            return {}
        return this_machine(config.parallel.sharded).environment(os.environ)

    def attention_impl(self, cache_dir: str | None = None) -> str:
        decodes = self._decode.describe(_cache_root(cache_dir))
        return f"decodes: {decodes}; prompt chunks and gathered decodes: {GATHER_IMPL}; linear weights packed for oneDNN"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        """Sharded: as many torch threads as this shard's slice of the cores (shard_cores),
        then the gloo group. A worker process is pinned to its slice; rank 0 is not, since it
        shares the engine's process (and what it starts later, e.g. grammar workers, would
        inherit the pinning): it runs on the slice the workers leave free."""
        self._local_shards = shard.local_world_size
        if not shard.sharded:
            logger.info("cpu runtime: %d torch threads; loaded: %s", torch.get_num_threads(),
                        ", ".join(loaded_libraries()) or "no OpenMP or allocator library")
        if shard.sharded:
            cores = shard_cores(sorted(os.sched_getaffinity(0)), shard.local_rank, shard.local_world_size)
            if shard.rank != 0:
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
            logger.info("shard %d on cores %s%s", shard.rank, cores, "" if shard.rank else " (unpinned)")
        super().init_device(shard)

    def available_memory_bytes(self) -> int:
        """This shard's share of the machine's available memory."""
        available = _meminfo_available_bytes()
        if available is None:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return available // self._local_shards

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        return CpuAttentionKernel(spec, self._plans, self._decode)

    def prepare_model(self, loaded, config) -> None:
        """Packs the linear weights for oneDNN (linear.py), then tells the remaining linears
        how this CPU multiplies a single row (tuning.py). The plain runner runs the result."""
        if self.pack_weights:
            pack_linears(loaded.model)
        choose_single_row_products(loaded.model)

    def make_runner(self, loaded, kv_caches: list[torch.Tensor], config):
        """The plain runner, once the in-place decode kernel is built or reused (extension.py;
        the gather path, with its reason logged, if it cannot be)."""
        self._decode.load(_cache_root(config.model.cache_dir))
        return super().make_runner(loaded, kv_caches, config)

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, spec: AttentionSpec) -> list[torch.Tensor]:
        """Zeroed caches whose pages the OS hands out on first touch (numpy's calloc),
        so a large cache costs nothing until it is used. Zeros matter: the kernel
        reads whole blocks, and masked slots must hold finite values."""
        import numpy as np

        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=spec.dtype).element_size()
        return [torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(spec.dtype).view(shape)
                for _ in range(num_layers)]
