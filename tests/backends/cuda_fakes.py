"""Fakes for the CUDA backend's device calls, so its logic runs on a CPU: a fake device
(memory readings, graphs that replay by re-running what was captured) and a
graph-safe reference attention kernel that reads only the metadata's tensors."""
from __future__ import annotations

from dataclasses import replace

import torch

from switchyard.backends.cuda import CudaBackend
from switchyard.core.backend import SINGLE_SHARD, AttentionKernel
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request
from switchyard.core.ops.attention import paged_attention_reference, write_kv_reference

MiB = 2**20
CUDA_KERNEL = None  # CpuCudaBackend(kernel=CUDA_KERNEL): the CUDA backend's own attention kernels


class FakeGraph:
    def __init__(self, run):
        self.run = run
        self.num_replays = 0

    def replay(self) -> None:
        self.num_replays += 1
        self.run()


class FakeDevice:
    """Memory in bytes as the driver would report it; capture() records without running."""

    pin_memory = False

    def __init__(self, free: int = 512 * MiB, total: int = 1024 * MiB, allocated: int = 100 * MiB,
                 peak: int = 108 * MiB):
        self.free, self.total, self.allocated, self.peak = free, total, allocated, peak
        self.calls: list[str] = []
        self.captured: dict[int, FakeGraph] = {}

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def mem_get_info(self) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.free, self.total

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak_memory_stats")

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def graph_pool(self) -> object:
        return "pool"

    def warm_up(self, run) -> None:
        self.calls.append("warm_up")
        run()

    def capture(self, run, pool) -> FakeGraph:
        assert pool == "pool"
        graph = FakeGraph(run)
        self.captured[len(self.captured)] = graph
        return graph


class DeviceReferenceKernel(AttentionKernel):
    """The reference ops, reading lengths from the device tensors as a graph-safe kernel
    must (a replayed graph sees new tensor values, never new host values); negative
    slots are skipped like the Triton kernel does."""

    graph_safe = True

    def write_kv(self, key, value, kv_cache, meta) -> None:
        keep = meta.slot_mapping >= 0
        write_kv_reference(key[keep], value[keep], kv_cache, meta.slot_mapping[keep])

    def forward(self, query, kv_cache, meta):
        return paged_attention_reference(query, kv_cache, meta.query_start_loc.tolist(), meta.seq_lens.tolist(),
                                         meta.block_table, self.spec.scale, self.spec.sliding_window,
                                         self.spec.soft_cap)


class CpuCudaBackend(CudaBackend):
    """The CUDA backend's logic on the CPU, over a fake device. `kernel(spec)` makes its
    attention kernels (default: DeviceReferenceKernel, fast); CUDA_KERNEL (None) keeps the
    CUDA backend's own choice (CudaBackend.attention: flash-attn where it is installed, else
    its Triton kernel, which a CPU runs under TRITON_INTERPRET=1)."""

    name = "cuda-on-cpu"

    def __init__(self, device_ops: FakeDevice | None = None, cuda_graphs: bool = True, kernel=DeviceReferenceKernel):
        super().__init__(device_ops=device_ops or FakeDevice(), cuda_graphs=cuda_graphs, fused_layers=False)
        self._device = torch.device("cpu")
        self._kernel = kernel

    def init_device(self, shard=SINGLE_SHARD) -> None:
        pass

    def capabilities(self):
        """The CUDA backend's, plus block size 4 (the tiny test engines'): the reference
        kernels these fakes run serve any block size."""
        caps = super().capabilities()
        return replace(caps, block_sizes=(4,) + caps.block_sizes)

    def attention(self, spec):
        if self._kernel is CUDA_KERNEL:
            return super().attention(spec)
        return self._kernel(spec)


def make_engine(backend, max_num_seqs=6, block_size=4, num_blocks=64, kv_cache_dtype="auto"):
    config = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", seed=3, max_model_len=96),
                          cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64))
    return EngineCore(config, backend=backend)


PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42]]


def generate(engine, prompts=PROMPTS, max_tokens=10):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(prompt), params))
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out
