"""Every torch.cuda call the CUDA backend makes outside its kernels, behind one small
object, so that the sizing and graph logic is unit-tested on a CPU with a fake."""
from __future__ import annotations

from typing import Callable

import torch


class CudaDevice:
    """The real device calls (torch.cuda; on a HIP build of torch the same calls drive ROCm)."""

    pin_memory = True

    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as the driver sees them (all processes)."""
        return torch.cuda.mem_get_info(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def graph_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def _capture_stream(self) -> torch.cuda.Stream:
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def warm_up(self, run: Callable[[], None]) -> None:
        """Runs run() once on the capture stream, so that lazy set-up (kernel compilation,
        library handles and workspaces of that stream) happens before, not during, capture."""
        stream = self._capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run()
        stream.synchronize()

    def capture(self, run: Callable[[], None], pool: object) -> torch.cuda.CUDAGraph:
        """Records run() into a graph whose replay() redoes its work on the same buffers."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a gateway, a tokenizer) do not break the capture.
        with torch.cuda.graph(graph, pool=pool, stream=self._capture_stream(), capture_error_mode="thread_local"):
            run()
        return graph
