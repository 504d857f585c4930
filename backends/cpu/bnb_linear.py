"""bitsandbytes weights on the CPU (core/quant/scaled.py "bnb_nf4", "bnb_fp4", "bnb_int8"; --quantize
bitsandbytes* and bitsandbytes checkpoints), multiplied by bitsandbytes' own ops
(torch.ops.bitsandbytes, bitsandbytes >= 0.46 ships CPU kernels for them), as its Linear4bit /
Linear8bitLt would on this CPU:

- 4-bit (`Bnb4bitLinear`): where bitsandbytes has its fused CPU kernel (AVX512-BF16, and out a
  multiple of 32), the weight is repacked once by bitsandbytes' own `_convert_weight_packed_for_cpu`
  (what Linear4bit.forward does on the first CPU call; absmax in bf16, as that kernel reads it) and
  up to GEMV_ROWS rows go through `gemv_4bit` (activations in bf16: that kernel's only dtype).
  Bigger batches, and CPUs without that kernel, dequantize the weight per call with bitsandbytes'
  `dequantize_4bit` into the activations' dtype and multiply it with torch; the copy is dropped
  after the call. The bitsandbytes layout is kept beside the repacked one for that (1 byte a weight in
  all, against 2 for bf16); without a batch path (batch_rows None) only the repacked one is kept.
- LLM.int8 (`BnbInt8Linear`): bitsandbytes' `int8_vectorwise_quant` rounds each activation row to
  int8 (input columns holding a value over THRESHOLD are taken out, in fp16) and
  `int8_mixed_scaled_mm` multiplies (torch._int_mm on the CPU) and adds the outlier columns against
  the dequantized weight columns in the activations' dtype (as bitsandbytes' MatMul8bitLt does).

Measured (idle 2-core AMX Xeon, one thread, 2048x2048, best of 20): nf4 gemv_4bit 0.21 ms at 1 row,
0.43 at 4, 0.81 at 8, 1.61 at 16, 3.09 at 32; dequantize_4bit to bf16 0.75 ms, the bf16 matmul
after it 0.46-0.55 (the bf16 weight alone 0.46 at 1 row, 0.55 at 32): hence GEMV_ROWS = 8. LLM.int8:
0.41 ms at 1 row, 0.84 at 32 (threshold 6.0).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from switchyard.core.quant import QuantizedWeight
from switchyard.core.quant.scaled import QUANT_TYPES

from ..bnb_ops import THRESHOLD, import_bnb, int8_matmul
from .quant import QuantizedLinear

logger = logging.getLogger(__name__)

GEMV_ROWS = 8  # rows up to which gemv_4bit beats dequantize_4bit + a bf16 matmul (measured above)
PACK_ROWS = 32  # bitsandbytes' CPU repacking works on blocks of 32 output rows


class Bnb4bitLinear(QuantizedLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, batch_rows: int | None = None):
        functional = import_bnb()
        out, inp = weight.shape
        fused = functional.has_avx512bf16() and out % PACK_ROWS == 0
        # rows > batch_rows: dequantize_4bit per call (every row where there is no fused kernel)
        rows = (None if batch_rows is None else min(batch_rows, GEMV_ROWS)) if fused else 0
        super().__init__(weight, bias, rows, keep_batch_copy=False)
        self.quant_type = QUANT_TYPES[weight.format]
        self.blocksize = inp // weight.scales.shape[1]
        code = functional.get_4bit_type(self.quant_type, device="cpu")
        self.register_buffer("code", code, persistent=False)
        flat, absmax = weight.data.reshape(-1, 1), weight.scales.reshape(-1)
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("packed_absmax", None, persistent=False)
        if fused:
            state = functional.QuantState(absmax=absmax.clone(), shape=torch.Size((out, inp)), code=code,
                                          blocksize=self.blocksize, quant_type=self.quant_type, dtype=torch.bfloat16)
            packed, state = functional._convert_weight_packed_for_cpu(flat.clone(), state)
            self.packed, self.packed_absmax = packed, state.absmax
        keep = not fused or rows is not None
        self.register_buffer("data", flat.contiguous() if keep else None, persistent=False)
        self.register_buffer("absmax", absmax.contiguous() if keep else None, persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.bitsandbytes.gemv_4bit.default(x.to(torch.bfloat16).contiguous(), self.packed,
                                                        [self.out_features, self.in_features], self.packed_absmax,
                                                        self.code, self.blocksize)
        return out.to(x.dtype)

    def multiply_batch(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.ops.bitsandbytes.dequantize_4bit.default(self.data, self.absmax, self.blocksize, self.quant_type,
                                                                 [self.out_features, self.in_features], x.dtype)
        return torch.nn.functional.linear(x, weight)

    def extra_repr(self) -> str:
        fused = "gemv_4bit" if self.packed is not None else "no fused CPU kernel"
        batch = "" if self.batch_rows is None else f", over {self.batch_rows} rows dequantize_4bit per call"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.format} "
                f"(blocks of {self.blocksize}), bitsandbytes {fused}{batch}")


class BnbInt8Linear(QuantizedLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__(weight, bias, None, keep_batch_copy=False)
        self.register_buffer("CB", weight.data.contiguous(), persistent=False)
        self.register_buffer("SCB", weight.scales.reshape(-1).contiguous(), persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x.contiguous(), self.CB, self.SCB)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bnb_int8 "
                f"(bitsandbytes LLM.int8, threshold {THRESHOLD})")


def bnb_kernel(weight: QuantizedWeight, bias: torch.Tensor | None, batch_rows: int | None) -> nn.Module | None:
    """The kernel module of one bitsandbytes-format weight (the quant.py hook); None without
    bitsandbytes (the weight is then dequantized, as pack_quantized logs)."""
    if import_bnb() is None:
        logger.warning("%s weights: bitsandbytes is not installed (pip install bitsandbytes)", weight.format)
        return None
    if weight.format == "bnb_int8":
        return BnbInt8Linear(weight, bias)
    return Bnb4bitLinear(weight, bias, batch_rows)
