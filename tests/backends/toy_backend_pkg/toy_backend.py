"""An out-of-tree backend for the plugin tests: plain torch on the CPU, reference attention."""
from __future__ import annotations

import torch

from switchyard.core.backend import AttentionKernel, AttentionSpec, Backend, Capabilities, ProbeResult
from switchyard.core.ops.attention import ReferenceAttentionKernel


class ToyBackend(Backend):
    name = "toy"
    priority = -10  # below cpu: usable, but never chosen unless asked for

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "toy backend, always usable")

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32",), block_sizes=(16,), attention_impl="reference (toy)")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def available_memory_bytes(self) -> int:
        return 1 << 30

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        return ReferenceAttentionKernel(spec)
