"""The plain-torch reference backend: the one every test compares with or builds models on
(the contract suite's engine output, the model and loader tests)."""
from __future__ import annotations

import torch

from ..backend import AttentionKernel, AttentionSpec, Backend, Capabilities, ProbeResult
from ..ops.attention import ReferenceAttentionKernel

# The reference kernel gathers whole blocks of any size: these cover every size a backend
# declares in this tree and the tiny test engines' 4.
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ReferenceBackend(Backend):
    """CPU, the reference attention kernel, the model exactly as loaded; no shards (no
    dist_backend). Serves `block_sizes` (a backend under test may declare any size)."""

    name = "reference"

    def __init__(self, *block_sizes: int):
        self.block_sizes = block_sizes or BLOCK_SIZES

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, "the plain-torch reference, for tests")

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "bfloat16", "float16"), block_sizes=tuple(self.block_sizes),
                            attention_impl="plain-torch reference attention", vision_encoders=True,
                            window_anchors=True)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def available_memory_bytes(self) -> int:
        return 1 << 30

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        return ReferenceAttentionKernel(spec)
