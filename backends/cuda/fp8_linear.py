"""float8 e4m3 weights (core/quant/scaled.py "fp8_e4m3": --quantize fp8 and FP8 checkpoints) on the
CUDA backend (quant.py installs it for every fp8_e4m3 weight).

On NVIDIA GPUs with fp8 tensor cores (compute capability 8.9: Ada, 9.0: Hopper, and later), a weight
scaled per channel (or per tensor) is multiplied by torch._scaled_mm in fp8 against activations
rounded to float8 with one dynamic scale per call (max |x| / 448, tensor-wise: the scaling every
fp8 GPU's _scaled_mm takes), the product scaled back by the activation scale in the call and by each
output channel's weight scale after it: W8A8, as vLLM's dynamic fp8. Elsewhere (older GPUs, ROCm's
float8 variant, the CPU of the tests) and for block-scaled weights (DeepSeek-V3 / Qwen3 FP8, which
have no tensor-wise form), the weight stays 1 byte a weight in memory and is dequantized per call
into the activations' dtype (weight-only); `reason` says which and why.
"""
from __future__ import annotations

import torch

from switchyard.core.quant import QuantizedWeight
from switchyard.core.quant.scaled import FP8_MAX

from .quant_linear import CudaQuantLinear

MIN_CAPABILITY = (8, 9)
ALIGN = 16  # _scaled_mm wants K and N multiples of 16


def fp8_supported(device: torch.device | None = None) -> bool:
    """Whether this device's GPU multiplies float8 e4m3fn (an NVIDIA GPU of compute capability >= 8.9)."""
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None) or \
            (device is not None and torch.device(device).type != "cuda"):
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def tensorwise_reason(weight: QuantizedWeight, device: torch.device) -> str | None:
    """Why `weight` cannot go through _scaled_mm on `device` (None: it can)."""
    if weight.scales.shape[1] != 1:
        return f"scaled per block of {weight.shape[1] // weight.scales.shape[1]} columns (no tensor-wise form)"
    if not fp8_supported(device):
        return "this device has no fp8 tensor cores (NVIDIA compute capability 8.9 or later)"
    if weight.shape[0] % ALIGN or weight.shape[1] % ALIGN:
        return f"shape {weight.shape} is not a multiple of {ALIGN} (torch._scaled_mm)"
    return None


class CudaFp8Linear(CudaQuantLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device):
        if weight.format != "fp8_e4m3":
            raise ValueError(f"CudaFp8Linear takes fp8_e4m3 weights, not {weight.format}")
        super().__init__(*weight.shape, weight.format, bias, weight.input_order, device)
        self.register_buffer("weight", weight.data.to(device).view(torch.float8_e4m3fn), persistent=False)
        self.register_buffer("scales", weight.scales.to(device), persistent=False)  # [out, groups]
        reason = tensorwise_reason(weight, torch.device(device))
        self.tensorwise = reason is None
        self.kernel = ("torch._scaled_mm (fp8 activations, one dynamic scale per call)" if self.tensorwise
                       else f"dequantized per call: {reason}")
        self.register_buffer("one", torch.ones((), device=device), persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tensorwise:
            return torch.nn.functional.linear(x, self._dequantized(x.dtype))
        scale = (x.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
        quantized = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(quantized, self.weight.t(), scale_a=scale, scale_b=self.one, out_dtype=torch.float32)
        return (out * self.scales[:, 0]).to(x.dtype)

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        groups = self.scales.shape[1]
        values = self.weight.to(torch.float32).reshape(self.out_features, groups, -1)
        return (values * self.scales[..., None]).reshape(self.out_features, self.in_features).to(dtype)
