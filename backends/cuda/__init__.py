"""CUDA backend (Triton / flash-attn kernels, CUDA graphs, NCCL): registered, probed, not implemented yet."""
from __future__ import annotations

from switchyard.core.backend import ProbeResult
from switchyard.core.plugins import PendingBackend


class CudaBackend(PendingBackend):
    name = "cuda"
    priority = 100
    planned_attention_impl = "Triton / flash-attn paged attention (planned)"

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            import torch

            if torch.version.cuda is None:
                return ProbeResult(False, "torch built without CUDA (torch.version.cuda is None)")
            if not torch.cuda.is_available():
                return ProbeResult(False, "torch.cuda.is_available() is False (no device or driver)")
        except Exception as error:
            return ProbeResult(False, f"probing CUDA failed: {error}")
        return ProbeResult(False, "a CUDA device is present, but the CUDA backend "
                                  "arrives with its own issue")
