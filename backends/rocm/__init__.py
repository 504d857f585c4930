"""ROCm backend (HIP build of torch, shared Triton kernels, RCCL): registered, probed, not implemented yet."""
from __future__ import annotations

from switchyard.core.backend import ProbeResult
from switchyard.core.plugins import PendingBackend


class RocmBackend(PendingBackend):
    name = "rocm"
    priority = 90
    planned_attention_impl = "Triton paged attention on HIP (planned)"

    @classmethod
    def probe(cls) -> ProbeResult:
        try:
            import torch

            if getattr(torch.version, "hip", None) is None:
                return ProbeResult(False, "torch built without ROCm (torch.version.hip is None)")
            if not torch.cuda.is_available():
                return ProbeResult(False, "no ROCm device visible to torch")
        except Exception as error:
            return ProbeResult(False, f"probing ROCm failed: {error}")
        return ProbeResult(False, "a ROCm device is present, but the ROCm backend "
                                  "arrives with its own issue")
