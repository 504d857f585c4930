"""The CPU's batched LoRA kernel (core/lora; Backend.lora_kernel): csrc/lora.cpp's shrink and
expand, punica's SGMV idea in C++ (runs of tokens with one adapter, 16-lane float32 sums, the
tasks split over threads where they are big enough; see the source's header).

A token's delta is bit for bit the same alone as in any batch. Without the extension (no
compiler, a failed build) or for what it does not take (float16, a y whose columns are strided),
the plain-torch reference (core/lora/kernel.py TorchLoraKernel) computes the deltas; the reason
is logged once, by the build.

One Zen 4 core (AVX-512), the default model's layer (hidden 576, intermediate 1536), 8 adapters of
rank 16, 7 shrinks + 7 expands (benchmarks/lora_kernel.py, whose docstring has the table): 0.12-0.24
of the base linears' time in float32, 0.28-0.45 in bfloat16, at 1-256 tokens; plain torch 0.2-6x.
"""
from __future__ import annotations

import os

import torch

from switchyard.core.backend import LoraBatch, LoraKernel
from switchyard.core.lora.kernel import TorchLoraKernel

from .extension import SOURCES, ExtensionBuild, build_extension, register_fake_once

LORA_SOURCE = os.path.join(SOURCES, "lora.cpp")
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def load_lora_ops(cache_root: str, isa: str = "auto", source: str = LORA_SOURCE) -> ExtensionBuild:
    """Builds (or reuses) csrc/lora.cpp at `isa` and registers its fake implementations (torch.compile)."""
    build = build_extension(cache_root, source, "CPU LoRA kernel", "LoRA deltas through plain torch (TorchLoraKernel)",
                            ("lora_shrink", "lora_expand"), isa)
    register_fake_once(build, "lora_shrink", lambda x, a, token_slots: x.new_empty((x.shape[0], a.shape[1])))
    register_fake_once(build, "lora_expand", lambda y, h, b, scales, token_slots: None)
    return build


class CpuLoraKernel(LoraKernel):
    """csrc/lora.cpp's ops (`ops`, a loaded extension's namespace), or the reference where `ops` is
    None (`reason` says why) and for operands the C++ does not take."""

    def __init__(self, ops=None, reason: str = "", isa: str = "auto") -> None:
        self.ops = ops
        self.reason = reason
        self.isa = isa  # the level it was built for (EngineConfig.isa)
        self._reference = TorchLoraKernel()

    @classmethod
    def load(cls, cache_root: str, isa: str = "auto") -> CpuLoraKernel:
        build = load_lora_ops(cache_root, isa)
        return cls(build.ops if build.available else None, build.reason, isa)

    @property
    def path(self) -> str:
        """For logs and /info: which kernel computes the deltas."""
        if self.ops is None:
            return f"plain torch ({self.reason or 'no extension'})"
        return f"C++ ({self.ops.lora_isa()})"

    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        if self.ops is not None and x.dtype in KERNEL_DTYPES and a.dtype in KERNEL_DTYPES:
            return self.ops.lora_shrink(x, a, batch.token_slots)
        return self._reference.shrink(x, a, batch)

    def expand(self, y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
               batch: LoraBatch) -> None:
        if (self.ops is not None and y.dtype in KERNEL_DTYPES and b.dtype in KERNEL_DTYPES and h.dtype == y.dtype
                and (y.stride(1) == 1 or y.shape[1] <= 1)):
            self.ops.lora_expand(y, h, b, scales if scales.dtype == torch.float32 else scales.float(),
                                 batch.token_slots)
        else:
            self._reference.expand(y, h, b, scales, batch)

    def __repr__(self) -> str:
        return f"CpuLoraKernel({self.path})"
