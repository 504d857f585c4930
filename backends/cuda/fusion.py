"""Points a loaded model's elementwise layers at fused Triton kernels.

Unfused, a bf16 RMSNorm is eight kernels, rotary four and SiLU-and-mul two; at batch 1
each is a few microseconds of a memory-bound step that should be all weight reads,
so fusing them (one kernel each) is most of what separates a decode step from its
roofline after CUDA graphs. The model code stays plain torch: its RMSNorm and
SiluAndMul modules get an instance-level `forward`, attention modules that hold
their rotary function as `rotary` get the fused one, and mixture-of-experts layers
(FusedMoE) get the grouped-GEMM Triton kernel as their `experts_impl`.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from switchyard.core.layers import RMSNorm, SiluAndMul
from switchyard.core.layers import apply_rotary as plain_apply_rotary
from switchyard.core.layers.fused_moe import FusedMoE
from switchyard.core.layers.fused_moe import fused_experts as plain_fused_experts


def _fused_rms_norm(module: RMSNorm, kernels):
    weight, eps = module.weight, module.eps

    def forward(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return kernels.rms_norm(x.reshape(-1, shape[-1]), weight, eps).view(shape)

    return forward


def _fused_silu_and_mul(kernels):
    def forward(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return kernels.silu_and_mul(x.reshape(-1, shape[-1])).view(*shape[:-1], shape[-1] // 2)

    return forward


def fuse_layers(model: nn.Module, kernels) -> dict[str, int]:
    """kernels: a namespace with rms_norm, silu_and_mul, apply_rotary and fused_experts
    (backends/cuda/kernels).
    Returns how many modules of each kind now run fused."""
    fused: Counter[str] = Counter()
    for module in model.modules():
        if type(module) is RMSNorm:
            module.forward = _fused_rms_norm(module, kernels)
            fused["rms_norm"] += 1
        elif type(module) is SiluAndMul:
            module.forward = _fused_silu_and_mul(kernels)
            fused["silu_and_mul"] += 1
        elif getattr(module, "rotary", None) is plain_apply_rotary:
            module.rotary = kernels.apply_rotary
            fused["rotary"] += 1
        elif isinstance(module, FusedMoE) and module.experts_impl is plain_fused_experts:
            module.experts_impl = kernels.fused_experts
            fused["moe"] += 1
    return dict(fused)
