"""Choices the CPU backend makes by measuring this CPU once, after the weights load.

Single-row products (batch-1 decode is nothing but these): whether matrix-vector
multiplication or F.linear's GEMM is faster depends on the CPU and on the torch
build (see core/layers/linear.py), so each distinct weight shape is timed both ways
and every Linear of that shape is told which to use.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from switchyard.core.layers import Linear


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of fn, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matvec_is_faster(weight: torch.Tensor, repeats: int = 5) -> bool:
    """Times one row through F.linear and through torch.mv on this weight, interleaved
    (the fastest of `repeats` tries each, so a busy neighbour skews both alike)."""
    row = torch.ones((1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    gemm = lambda: F.linear(row, weight)  # noqa: E731
    gemv = lambda: torch.mv(weight, row[0])  # noqa: E731
    gemm(), gemv()  # first calls pay for packing and page faults
    gemm_s = gemv_s = float("inf")
    for _ in range(repeats):
        gemm_s = min(gemm_s, best_seconds(gemm, 2))
        gemv_s = min(gemv_s, best_seconds(gemv, 2))
    return gemv_s < gemm_s


@torch.inference_mode()
def choose_single_row_products(model: nn.Module) -> dict[tuple, bool]:
    """Sets `single_row_matvec` on every Linear of the model; returns the choice per
    (out_features, in_features, dtype)."""
    choices: dict[tuple, bool] = {}
    for module in model.modules():
        if not isinstance(module, Linear) or module.weight.device.type != "cpu":
            continue
        key = (*module.weight.shape, module.weight.dtype)
        if key not in choices:
            choices[key] = matvec_is_faster(module.weight)
        module.single_row_matvec = choices[key]
    return choices
