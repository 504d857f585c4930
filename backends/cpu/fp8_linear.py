"""float8 e4m3 weights on the CPU (core/quant/scaled.py "fp8_e4m3"; --quantize fp8 and FP8
checkpoints), weight-only: the weight stays 1 byte a weight in memory, activations in their dtype.

`Fp8Linear` multiplies up to KERNEL_ROWS rows (or `batch_rows`, if fewer) with csrc/fp8_matmul.cpp,
which dequantizes each group (a channel's row, or a 128-column block) in registers and sums in
float32. Bigger batches (compute-bound) dequantize the weight per call into one matrix in the
activations' dtype (weight-only: a float32 model's activations are not rounded to bf16), multiplied
by oneDNN and dropped after the call. Without the extension (no compiler, a failed build, groups
that are not a multiple of 16 columns) the weight is dequantized per call in chunks of CHUNK_ROWS
rows, never kept whole in floats.

2-core AMX Xeon (shared), one 2048x2048 weight, bf16 rows, one thread, best of 20
(benchmarks/scaled_quant.py): fp8 kernel 0.30 ms at 1 row, 0.42 at 4, 0.80 at 8, 1.58 at 16, 3.16
at 32; fp8_dequantize + bf16 matmul 1.05-1.16 ms at 1-32 rows (0.52 of it the dequantization,
most of that first-touching the fresh 8 MB); the bf16 weight packed by oneDNN 0.36 ms at 1 row, 0.38
at 32 (AMX). Hence KERNEL_ROWS = 8.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from switchyard.core.quant import QuantizedWeight

from .extension import SOURCES, ExtensionBuild, build_extension, register_fake_once
from .quant import QuantizedLinear

FP8_SOURCE = os.path.join(SOURCES, "fp8_matmul.cpp")
CHUNK_ROWS = 256  # output rows dequantized at a time by the torch path
STEP = 16  # the kernel's group unit (columns)
KERNEL_ROWS = 8  # rows up to which the kernel beats fp8_dequantize + a matmul (measured above)


def load_fp8_kernel(cache_root: str, source: str = FP8_SOURCE) -> ExtensionBuild:
    """Builds (or reuses) the fp8 matmul and registers its fake implementations (torch.compile)."""
    build = build_extension(cache_root, source, "CPU fp8 matmul", "fp8 weights dequantized per call in chunks",
                            ("fp8_mm", "fp8_dequantize"))
    register_fake_once(build, "fp8_mm", lambda x, data, scales, bias: x.new_empty((x.shape[0], data.shape[0])))
    register_fake_once(build, "fp8_dequantize",
                       lambda data, scales, dtype: data.new_empty(data.shape, dtype=dtype))
    return build


def dequantize_chunk(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of an fp8_e4m3 weight in `dtype` (torch's own float8 conversion)."""
    rows, inp = data.shape
    groups = scales.shape[1]
    values = data.view(torch.float8_e4m3fn).float().reshape(rows, groups, inp // groups)
    return (values * scales[..., None]).reshape(rows, inp).to(dtype)


class Fp8Linear(QuantizedLinear):
    """`ops`: the loaded extension's namespace, or None (the chunked torch path)."""

    def __init__(self, weight: QuantizedWeight, ops, bias: torch.Tensor | None = None, batch_rows: int | None = None):
        super().__init__(weight, bias, None if batch_rows is None else min(batch_rows, KERNEL_ROWS),
                         keep_batch_copy=False)
        group = weight.shape[1] // weight.scales.shape[1]
        self.ops = ops if group % STEP == 0 else None
        self.register_buffer("data", weight.data.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.contiguous(), persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.fp8_mm(x, self.data, self.scales, None)
        return self._chunked(x)

    def multiply_batch(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is None or x.dtype not in (torch.float32, torch.bfloat16):
            return self._chunked(x)
        return torch.nn.functional.linear(x, self.ops.fp8_dequantize(self.data, self.scales, x.dtype))

    def _chunked(self, x: torch.Tensor) -> torch.Tensor:
        """Every row at once against CHUNK_ROWS output rows dequantized at a time, in x's dtype."""
        rows = range(0, self.out_features, CHUNK_ROWS)
        outs = [torch.nn.functional.linear(x, dequantize_chunk(self.data[i:i + CHUNK_ROWS],
                                                               self.scales[i:i + CHUNK_ROWS], x.dtype)) for i in rows]
        return torch.cat(outs, dim=1)

    def extra_repr(self) -> str:
        path = "fp8 kernel" if self.ops is not None else f"dequantized per call in chunks of {CHUNK_ROWS} rows"
        batch = "" if self.batch_rows is None else f", batches over {self.batch_rows} rows: dequantized per call"
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3 "
                f"({self.scales.shape[1]} scales a row), {path}{batch}")


def fp8_kernel(weight: QuantizedWeight, bias: torch.Tensor | None, batch_rows: int | None) -> nn.Module:
    """The kernel module of one fp8_e4m3 weight (the quant.py hook)."""
    from switchyard.core.loader.gguf_cache import default_cache_root

    build = load_fp8_kernel(default_cache_root())
    return Fp8Linear(weight, build.ops if build.available else None, bias, batch_rows)
