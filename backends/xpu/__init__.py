"""Intel XPU backend: IPEX paged attention, torch.xpu memory sizing, oneCCL shards (backend.py).
Importing it imports neither IPEX nor touches a device."""
from .backend import XpuBackend

__all__ = ["XpuBackend"]
