"""The plain-torch reference backend the contract suite compares a backend's engine output with."""
from __future__ import annotations

import torch

from ..backend import AttentionKernel, AttentionSpec, Backend, Capabilities, ProbeResult
from ..ops.attention import ReferenceAttentionKernel


class ReferenceBackend(Backend):
    """CPU, the reference attention kernel, the model exactly as loaded. Serves the block size
    it is built with (so it can run whatever block size the backend under test declares)."""

    name = "reference"

    def __init__(self, block_size: int = 16):
        self.block_size = block_size

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "the plain-torch reference, for tests")

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "bfloat16", "float16"), block_sizes=(self.block_size,),
                            attention_impl="plain-torch reference attention")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def available_memory_bytes(self) -> int:
        return 1 << 30

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        return ReferenceAttentionKernel(spec)
