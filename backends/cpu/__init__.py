"""The CPU backend: the embedded default (SDPA over gathered blocks, gloo, multiprocess launcher)."""
from .attention import CpuAttentionKernel, StepPlanCache
from .backend import CpuBackend
from .distributed import GlooCommunicator, MultiprocessLauncher, init_process_group

__all__ = ["CpuAttentionKernel", "CpuBackend", "GlooCommunicator", "MultiprocessLauncher",
           "StepPlanCache", "init_process_group"]
