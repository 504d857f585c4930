"""Every torch.xpu call the XPU backend makes outside its kernels, behind one small object,
so that probing, memory sizing and shard placement are unit-tested on a CPU with a fake.

The method names match backends/cuda/device.py where the idea is the same, so the generic
warm-up profiling of backends/cuda/memory.py drives either."""
from __future__ import annotations

import torch


class XpuDevice:
    """The real device calls (torch.xpu, present in torch >= 2.4; an XPU build of torch
    drives Intel GPUs through Level Zero)."""

    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def compiled() -> bool:
        """Whether this torch build has XPU support at all (the PyPI CUDA wheels do not)."""
        return torch.xpu._is_compiled()

    @staticmethod
    def is_available() -> bool:
        return torch.xpu.is_available()

    @staticmethod
    def device_count() -> int:
        return torch.xpu.device_count()

    def set_device(self) -> None:
        torch.xpu.set_device(self.device)

    def name(self) -> str:
        return torch.xpu.get_device_properties(self.device).name

    def synchronize(self) -> None:
        torch.xpu.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.xpu.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device. torch.xpu.mem_get_info asks the driver (all
        processes); where the driver does not report free memory it raises, and the total
        less what this process reserved is the honest fallback."""
        try:
            return torch.xpu.mem_get_info(self.device)
        except RuntimeError:
            total = torch.xpu.get_device_properties(self.device).total_memory
            return total - torch.xpu.memory_reserved(self.device), total

    def reset_peak_memory_stats(self) -> None:
        torch.xpu.reset_peak_memory_stats(self.device)

    def memory_allocated(self) -> int:
        return torch.xpu.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.xpu.max_memory_allocated(self.device)
