"""bitsandbytes weights on the CUDA backend (core/quant/scaled.py "bnb_nf4", "bnb_fp4", "bnb_int8";
--quantize bitsandbytes* and bitsandbytes checkpoints), multiplied by bitsandbytes' own CUDA ops, as
its Linear4bit / Linear8bitLt run inference on a GPU:

- 4-bit (`CudaBnb4bitLinear`): `torch.ops.bitsandbytes.gemm_4bit` over bitsandbytes' own packing
  (the weight's bytes as bitsandbytes.functional.quantize_4bit made them, absmax per block already
  dequantized: what matmul_4bit passes for a non-nested quant state). bitsandbytes picks its fused
  kernel for small batches and dequantize_4bit + a GEMM past them.
- LLM.int8 (`CudaBnbInt8Linear`): backends/bnb_ops.py `int8_matmul` (int8_vectorwise_quant, then
  int8_mixed_scaled_mm). Finding the outlier columns syncs with the host, so a model holding one runs
  its decode steps without CUDA graphs (graph_safe = False; graphs.py says so once).
The ops dispatch on the tensors' device, so the tests run the same modules on the CPU.
"""
from __future__ import annotations

import torch

from switchyard.core.quant import QuantizedWeight
from switchyard.core.quant.scaled import QUANT_TYPES

from ..bnb_ops import THRESHOLD, int8_matmul
from .quant_linear import CudaQuantLinear


class CudaBnb4bitLinear(CudaQuantLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device):
        super().__init__(*weight.shape, weight.format, bias, weight.input_order, device)
        self.quant_type = QUANT_TYPES[weight.format]
        self.blocksize = self.in_features // weight.scales.shape[1]
        self.register_buffer("data", weight.data.to(device).reshape(-1, 1).contiguous(), persistent=False)
        self.register_buffer("absmax", weight.scales.to(device).reshape(-1).contiguous(), persistent=False)
        self.kernel = f"bitsandbytes gemm_4bit ({self.quant_type}, blocks of {self.blocksize})"

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.bitsandbytes.gemm_4bit.default(x, self.data, [self.out_features, self.in_features],
                                                         self.absmax, self.blocksize, self.quant_type)


class CudaBnbInt8Linear(CudaQuantLinear):
    graph_safe = False  # the outlier columns are found on the host

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device):
        super().__init__(*weight.shape, weight.format, bias, weight.input_order, device)
        self.register_buffer("CB", weight.data.to(device).contiguous(), persistent=False)
        self.register_buffer("SCB", weight.scales.to(device).reshape(-1).contiguous(), persistent=False)
        self.kernel = f"bitsandbytes LLM.int8 (threshold {THRESHOLD})"

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x.contiguous(), self.CB, self.SCB)
