"""The CUDA backend: Triton paged attention (flash-attn varlen when installed and fit),
quantized weights packed for their GPU kernels (quant.py: the Triton dequantize-GEMM, Marlin,
torch._scaled_mm fp8, bitsandbytes), CUDA graphs for decode steps, warm-up memory profiling,
NCCL and one process per GPU."""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import ClassVar

import torch

from switchyard.core.backend import (SINGLE_SHARD, AttentionKernel, AttentionSpec, Backend, Capabilities, LoraKernel,
                                     ProbeResult, ShardInfo)
from switchyard.core.shards.process_group import ProcessGroupShards
from switchyard.core.config import CacheConfig, EngineConfig
from switchyard.core.quant.methods import served_by

from .device import CudaDevice
from switchyard.core.shards.distributed import init_process_group

from .distributed import GpuShardLauncher
from .flash import AttentionChoice, FlashAttnKernel, choose_attention, describe_attention, flash_attn_module
from .fusion import fuse_layers
from .graphs import CudaGraphRunner
from .memory import MemoryProfile, num_kv_blocks_from_profile, profile_run
from .quant import KernelTarget, has_quantized, pack_quantized

logger = logging.getLogger(__name__)


def probe_cuda() -> ProbeResult:
    """Usable when torch is a CUDA build, a device is visible and Triton is installed;
    creates no CUDA context."""
    try:
        if getattr(torch.version, "hip", None):
            return ProbeResult(False, f"torch {torch.__version__} is a ROCm (HIP) build: the rocm backend serves it")
        if torch.version.cuda is None:
            return ProbeResult(False, f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None)")
        if not torch.cuda.is_available():
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f"; CUDA_VISIBLE_DEVICES={shown!r}" if shown is not None else ""
            return ProbeResult(False, f"no CUDA device visible (torch.cuda.is_available() is False{where})")
        if importlib.util.find_spec("triton") is None:
            return ProbeResult(False, "triton is not installed (pip install 'switchyard[cuda]')")
        count = torch.cuda.device_count()
        return ProbeResult(True, f"{count} CUDA device{'s' if count != 1 else ''} visible "
                                 f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    except Exception as error:
        return ProbeResult(False, f"probing CUDA failed: {type(error).__name__}: {error}")


class CudaBackend(ProcessGroupShards, Backend):
    name = "cuda"
    priority = 100
    dist_backend = "nccl"  # RCCL on ROCm's HIP build, under the same name
    planned_attention_impl: ClassVar[str] = "triton paged attention, or flash-attn varlen when installed"

    def __init__(self, device_ops=None, cuda_graphs: bool = True, fused_layers: bool = True):
        """device_ops: the device calls (default: the real ones, backends/cuda/device.py);
        cuda_graphs: capture decode graphs; fused_layers: fused Triton RMSNorm/rotary/SiLU."""
        self._device = torch.device("cuda", 0)
        self._device_ops = device_ops
        self.cuda_graphs = cuda_graphs
        self.fused_layers = fused_layers
        self.fused: dict[str, int] = {}
        self.quantized: dict[str, int] = {}  # kernel kind -> how many linears it took (prepare_model)
        self.memory_profile: MemoryProfile | None = None
        self.attention_choices: dict[AttentionSpec, AttentionChoice] = {}
        self._lora: LoraKernel | None = None

    @classmethod
    def probe(cls) -> ProbeResult:
        return probe_cuda()

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("bfloat16", "float16", "float32"), block_sizes=(16, 32, 64, 128, 256),
                            mixed_prefill_decode=True, prefix_caching=True, graph_mode=True,
                            static_shapes=False, attention_impl=describe_attention(flash_attn_module()),
                            quantizations=served_by(self.name),
                            # a verify step's tokens are decode rows (core/execution/runner.py decodes_by_row), run
                            # eagerly: the decode graphs take steps of one token per request
                            multi_token_decode=True,
                            # the Triton kernels write and read them (flash-attn is not chosen for them)
                            kv_cache_dtypes=("int8", "fp8_e4m3fn", "fp8_e5m2"),
                            # the Triton shrink and expand (kernels/lora.py)
                            lora=True,
                            # the Triton kernel; flash-attn's sliding layers hand such steps to it (flash.py)
                            window_anchors=True,
                            # the towers are plain torch modules (core/models/siglip.py, qwen2_vision.py) on the GPU
                            vision_encoders=True)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def device_ops(self):
        if self._device_ops is None:
            self._device_ops = CudaDevice(self._device)
        return self._device_ops

    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        """Uses visible GPU shard.local_rank; joins the NCCL (RCCL) group when sharded."""
        self._device = torch.device("cuda", shard.local_rank)
        torch.cuda.set_device(self._device)
        if shard.sharded:
            init_process_group(shard, self.dist_backend, device=self._device)

    def available_memory_bytes(self) -> int:
        if self.memory_profile is not None:
            return self.memory_profile.available_bytes
        return self.device_ops.mem_get_info()[0]

    def prepare_model(self, loaded, config: EngineConfig) -> None:
        """Swaps quantized linears for their GPU kernels (quant.py; self.quantized counts them by
        kind), then points the model's norms, rotary, SiLU-and-mul and experts at fused Triton
        kernels (fusion.py), unless fused_layers is off; self.fused counts what was swapped."""
        if has_quantized(loaded.model):
            self.quantized = pack_quantized(loaded.model, KernelTarget.of(self.device, loaded.dtype))
        if self.fused_layers:
            from . import kernels

            self.fused = fuse_layers(loaded.model, kernels)

    def profile_run(self, loaded, config: EngineConfig) -> None:
        """Runs and measures a largest step (the model is already prepared)."""
        self.memory_profile = profile_run(loaded.model, self, self.device_ops, loaded.attention_spec,
                                          loaded.num_layers, config.scheduler.max_num_batched_tokens,
                                          config.scheduler.max_num_seqs)
        profile, gib = self.memory_profile, 2**30
        logger.info("memory after a largest step: %.2f GiB free of %.2f GiB, activation peak %.2f GiB",
                    profile.free_bytes / gib, profile.total_bytes / gib, profile.activation_peak_bytes / gib)

    def num_kv_blocks(self, bytes_per_block: int, cache: CacheConfig) -> int:
        profile = self.memory_profile
        if profile is None:
            free, total = self.device_ops.mem_get_info()
            profile = MemoryProfile(free, total, 0)
        return num_kv_blocks_from_profile(profile, bytes_per_block, cache)

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        flash_attn = flash_attn_module()
        choice = choose_attention(spec, flash_attn)
        self.attention_choices[spec] = choice
        if choice.impl == "flash-attn":
            anchored = triton_attention(spec) if spec.sliding_window is not None else None  # window anchors' steps
            return FlashAttnKernel(spec, flash_attn.flash_attn_varlen_func, triton_write_kv, anchored)
        return triton_attention(spec)

    def lora_kernel(self) -> LoraKernel:
        """The Triton shrink and expand (kernels/lora.py; triton imported at the first call)."""
        if self._lora is None:
            from .kernels.lora import TritonLoraKernel

            self._lora = TritonLoraKernel()
        return self._lora

    def make_runner(self, loaded, kv_caches: list[torch.Tensor], config: EngineConfig) -> CudaGraphRunner:
        runner = CudaGraphRunner(loaded.model, self, kv_caches, config.cache.block_size,
                                 max_num_seqs=config.scheduler.max_num_seqs, max_model_len=loaded.max_model_len,
                                 vocab_size=loaded.vocab_size, device_ops=self.device_ops, enabled=self.cuda_graphs,
                                 sizes=config.graph_batch_sizes)
        runner.capture()
        return runner

    def shard_launcher(self) -> GpuShardLauncher:
        return GpuShardLauncher()


def triton_attention(spec: AttentionSpec) -> AttentionKernel:
    from .attention import TritonAttentionKernel

    return TritonAttentionKernel(spec)


def triton_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The Triton KV scatter (negative slots skipped); triton is imported at the first call."""
    from .kernels import write_kv

    write_kv(key, value, kv_cache, slot_mapping)
