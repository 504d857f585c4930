"""The CPU backend: the embedded default (SDPA over gathered blocks; shards over gloo, pinned to disjoint cores)."""
from .attention import CpuAttentionKernel, StepPlanCache
from .backend import CpuBackend

__all__ = ["CpuAttentionKernel", "CpuBackend", "StepPlanCache"]
