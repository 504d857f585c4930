"""CUDA backend: Triton paged attention (flash-attn varlen when installed), CUDA graphs for
decode steps, warm-up memory profiling, NCCL communicator and one process per GPU."""
from .backend import CudaBackend, probe_cuda
from .distributed import GpuShardLauncher, visible_device_ids
from switchyard.core.execution.decode_batch import bucket_for, capture_sizes

from .graphs import CudaGraphRunner

__all__ = ["CudaBackend", "CudaGraphRunner", "GpuShardLauncher", "bucket_for",
           "capture_sizes", "probe_cuda", "visible_device_ids"]
