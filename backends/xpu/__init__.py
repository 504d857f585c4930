"""Intel XPU backend (torch.xpu, intel-extension-for-pytorch, CCL): registered, probed, not implemented yet."""
from __future__ import annotations

import importlib.util

from switchyard.core.backend import ProbeResult
from switchyard.core.plugins import PendingBackend


class XpuBackend(PendingBackend):
    name = "xpu"
    priority = 80
    planned_attention_impl = "intel-extension-for-pytorch paged attention (planned)"

    @classmethod
    def probe(cls) -> ProbeResult:
        missing = []
        try:
            import torch

            xpu = getattr(torch, "xpu", None)
            if xpu is None or not xpu.is_available():
                missing.append("no torch.xpu device")
            if importlib.util.find_spec("intel_extension_for_pytorch") is None:
                missing.append("intel-extension-for-pytorch not installed")
        except Exception as error:
            missing.append(f"probing XPU failed: {error}")
        if missing:
            return ProbeResult(False, "; ".join(missing))
        return ProbeResult(False, "an XPU device is present, but the XPU backend "
                                  "arrives with its own issue")
