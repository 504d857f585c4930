"""Marlin (IST-DASLab's fp16/bf16 x int4 GEMM for NVIDIA sm80+), where a package that ships it is
installed: vLLM (`vllm._custom_ops.gptq_marlin_repack` and marlin_utils' `apply_gptq_marlin_linear`)
or gptqmodel (`gptqmodel.utils.marlin`, the same functions adapted from vLLM). Switchyard builds no
Marlin of its own; without either package the Triton dequantize-GEMM serves these weights.

`MarlinApi` holds the five functions both packages share, under the signatures they share:
repack(qweight, perm, size_k, size_n, num_bits), permute_scales(s, size_k, size_n, group_size),
make_workspace(device), empty_g_idx(device) and apply_gptq_marlin_linear's keywords (input, weight,
weight_scale, weight_zp, g_idx, g_idx_sort_indices, workspace, wtype, output_size_per_partition,
input_size_per_partition, is_k_full), plus the scalar type of symmetric 4-bit codes (uint4b8: u - 8).
`find_marlin` looks once per process.

`MarlinLinear` takes a symmetric 4-bit weight in the GPTQ layout backends/cuda/packed_codes.py
holds (int32 [K / 8, N], 8 codes a word along K; scales [K / group, N]), repacks it once into
Marlin's tiles and permutes the scales as the packages' own GPTQ-Marlin layers do. Act-order is
already applied to x by CudaQuantLinear (the columns are sorted by group), so Marlin gets no g_idx
and K is full.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .packed_codes import PackedCodes
from .quant_linear import CudaQuantLinear

logger = logging.getLogger(__name__)

MARLIN_GROUPS = (128,)  # besides one group per row (channel-wise, Marlin's group_size -1)
MIN_N, MIN_K = 64, 128  # Marlin's GPTQ_MARLIN_MIN_THREAD_N / _K
MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class MarlinApi:
    source: str  # the package it comes from, for the log
    repack: Callable[..., torch.Tensor]
    permute_scales: Callable[..., torch.Tensor]
    make_workspace: Callable[[torch.device], torch.Tensor]
    empty_g_idx: Callable[[torch.device], torch.Tensor]
    apply: Callable[..., torch.Tensor]
    uint4b8: Any


def _from_vllm() -> MarlinApi:
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils
    from vllm.scalar_type import scalar_types

    return MarlinApi("vLLM", ops.gptq_marlin_repack, marlin_utils.marlin_permute_scales,
                     marlin_utils.marlin_make_workspace_new, marlin_utils.marlin_make_empty_g_idx,
                     marlin_utils.apply_gptq_marlin_linear, scalar_types.uint4b8)


def _from_gptqmodel() -> MarlinApi:
    from gptqmodel.utils import marlin
    from gptqmodel.utils.marlin_scalar_type import scalar_types

    if marlin.marlin_import_exception is not None:  # gptqmodel's own verdict on this machine
        raise ImportError(str(marlin.marlin_import_exception))
    return MarlinApi("gptqmodel", marlin.gptq_marlin_repack, marlin.marlin_permute_scales,
                     marlin.marlin_make_workspace_new, marlin.marlin_make_empty_g_idx,
                     marlin.apply_gptq_marlin_linear, scalar_types.uint4b8)


@functools.lru_cache(maxsize=1)
def find_marlin() -> MarlinApi | None:
    """vLLM's Marlin, else gptqmodel's, else None (each failure logged once at debug level)."""
    for source in (_from_vllm, _from_gptqmodel):
        try:
            return source()
        except Exception as error:  # noqa: BLE001 - an optional package that does not import is absent
            logger.debug("Marlin from %s: %s: %s", source.__name__, type(error).__name__, error)
    return None


def marlin_refusal(packed: PackedCodes, symmetric: bool, dtype: torch.dtype,
                   capability: tuple[int, int] | None, api: MarlinApi | None) -> str | None:
    """Why Marlin does not take this weight (None: it does): symmetric 4-bit codes in groups of 128
    or one per row, fp16/bf16 activations, N % 64 and K % 128 zero, an NVIDIA GPU of sm80+ and a
    package that ships Marlin."""
    n, k = packed.shape
    if api is None:
        return "no Marlin package (vLLM or gptqmodel) is installed"
    if capability is None or capability < MIN_CAPABILITY:
        return "Marlin needs an NVIDIA GPU of compute capability 8.0 or later"
    if packed.bits != 4 or not symmetric:
        return "Marlin takes symmetric 4-bit weights (GPTQ-style) only"
    if packed.group not in MARLIN_GROUPS and packed.group != k:
        return f"groups of {packed.group} (Marlin: {', '.join(map(str, MARLIN_GROUPS))} or per channel)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"activations in {str(dtype).removeprefix('torch.')} (Marlin: float16 or bfloat16)"
    if n % MIN_N or k % MIN_K:
        return f"shape ({n}, {k}) (Marlin: out a multiple of {MIN_N}, in of {MIN_K})"
    return None


class MarlinLinear(CudaQuantLinear):
    def __init__(self, packed: PackedCodes, fmt: str, bias: torch.Tensor | None, input_order: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device, api: MarlinApi):
        n, k = packed.shape
        super().__init__(n, k, fmt, bias, input_order, device)
        self.api = api
        group = -1 if packed.group == k else packed.group
        empty = api.empty_g_idx(device).data  # an empty int tensor (a Parameter in the packages)
        self.register_buffer("qweight", api.repack(packed.codes.to(device).contiguous(), empty, k, n, 4),
                             persistent=False)
        self.register_buffer("scales", api.permute_scales(packed.scales.to(device, dtype).contiguous(), k, n, group),
                             persistent=False)
        self.register_buffer("workspace", api.make_workspace(device), persistent=False)
        self.register_buffer("empty", empty, persistent=False)
        self.kernel = f"Marlin ({api.source}; {'per channel' if group == -1 else f'groups of {group}'})"

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return self.api.apply(input=x, weight=self.qweight, weight_scale=self.scales, weight_zp=self.empty,
                              g_idx=self.empty, g_idx_sort_indices=self.empty, workspace=self.workspace,
                              wtype=self.api.uint4b8, output_size_per_partition=self.out_features,
                              input_size_per_partition=self.in_features, is_k_full=True)
