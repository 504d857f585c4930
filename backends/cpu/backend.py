"""The embedded default backend: always usable, plain torch on the host CPU."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from switchyard.core.backend import AttentionKernel, AttentionSpec, Backend, Capabilities, ProbeResult

from .attention import CpuAttentionKernel, StepPlanCache
from .extension import PagedDecode
from .distributed import GlooCommunicator, MultiprocessLauncher, init_process_group
from .linear import pack_linears, packing_supported
from .tuning import choose_single_row_products

GATHER_IMPL = ("SDPA over gathered blocks (torch scaled_dot_product_attention; decodes in groups of 16, "
               "short bf16 ones as one batched matmul; one call per prompt chunk)")


def _cache_root(cache_dir: str | None) -> str:
    """Where compiled kernels are kept: the model's cache_dir (ModelConfig), else ~/.cache/switchyard."""
    from switchyard.core.loader.gguf_cache import default_cache_root

    return cache_dir or default_cache_root()


def _meminfo_available_bytes(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class CpuBackend(Backend):
    name = "cpu"
    priority = 0

    def __init__(self, pack_weights: bool = True, in_place_decode: bool = True) -> None:
        self._plans = StepPlanCache()  # shared by every layer's kernel: one plan per step
        # Decode attention in place (C++, built at warm-up); in_place_decode=False forces the gather path.
        self._decode = PagedDecode(enabled=in_place_decode)
        # Reorder float32/bf16 linear weights for oneDNN once, at load (see linear.py).
        self.pack_weights = pack_weights and packing_supported()

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "always available")

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "bfloat16"), block_sizes=(8, 16, 32, 64, 128, 256),
                            mixed_prefill_decode=True, prefix_caching=True, graph_mode=False,
                            static_shapes=False, attention_impl=self.attention_impl())

    def attention_impl(self, cache_dir: str | None = None) -> str:
        decodes = self._decode.describe(_cache_root(cache_dir))
        return f"decodes: {decodes}; prompt chunks and gathered decodes: {GATHER_IMPL}; linear weights packed for oneDNN"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def init_device(self) -> None:
        """Joins the gloo process group when launched sharded (WORLD_SIZE > 1 set by the launcher)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size > 1:
            init_process_group(int(os.environ["RANK"]), world_size, "gloo")

    def available_memory_bytes(self) -> int:
        available = _meminfo_available_bytes()
        if available is not None:
            return available
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        return CpuAttentionKernel(spec, self._plans, self._decode)

    def make_runner(self, loaded, kv_caches: list[torch.Tensor], config):
        """The plain runner, once the linear weights are packed for oneDNN (linear.py) and
        the remaining linears know how this CPU multiplies a single row (tuning.py), and the
        in-place decode kernel is built or reused (extension.py; the gather path if it fails)."""
        self._decode.load(_cache_root(config.model.cache_dir))
        if self.pack_weights:
            pack_linears(loaded.model)
        choose_single_row_products(loaded.model)
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

    def communicator(self) -> GlooCommunicator | None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return GlooCommunicator()
        return None

    def shard_launcher(self) -> MultiprocessLauncher:
        return MultiprocessLauncher()
