"""float8 e4m3 weights (core/quant/scaled.py "fp8_e4m3") on NVIDIA GPUs with fp8 tensor cores
(compute capability 8.9: Ada, 9.0: Hopper, and later) through torch._scaled_mm.

Not wired in yet: the CUDA backend declares no quantizations (its prepare_model swaps no kernels),
so `--quantize fp8` is refused there in one line; this module is what such a hook would install.
Untested here (no GPU on the machine that wrote it); the CPU tests import it.

`CudaFp8Linear`: per-channel (or per-tensor) weights are multiplied in fp8 against activations
rounded to float8 with one dynamic scale per call (max |x| / 448, tensor-wise: the scaling every
fp8 GPU's _scaled_mm takes), the product scaled back by the activation scale in the call and by
each output channel's weight scale after it. Block-scaled weights (DeepSeek-V3 / Qwen3 FP8) have
no tensor-wise form: they are dequantized per call into the activations' dtype (weight-only) until
torch's block-scaled _scaled_mm is used here.
"""
from __future__ import annotations

import torch
from torch import nn

from switchyard.core.quant import QuantizedWeight
from switchyard.core.quant.scaled import FP8_MAX

MIN_CAPABILITY = (8, 9)
ALIGN = 16  # _scaled_mm wants K and N multiples of 16


def fp8_supported(device: torch.device | None = None) -> bool:
    """Whether this device's GPU multiplies float8 (compute capability >= 8.9)."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


class CudaFp8Linear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        if weight.format != "fp8_e4m3":
            raise ValueError(f"CudaFp8Linear takes fp8_e4m3 weights, not {weight.format}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.data.view(torch.float8_e4m3fn).to(device), persistent=False)
        self.register_buffer("scales", weight.scales.to(device), persistent=False)  # [out, groups]
        self.register_buffer("bias", None if bias is None else bias.to(device), persistent=False)
        self.tensorwise = (weight.scales.shape[1] == 1 and fp8_supported(device)
                           and self.in_features % ALIGN == 0 and self.out_features % ALIGN == 0)
        self.register_buffer("one", torch.ones((), device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tensorwise:
            return nn.functional.linear(x, self._dequantized(x.dtype), self.bias)
        rows = x.reshape(-1, self.in_features)
        scale = (rows.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
        quantized = (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(quantized, self.weight.t(), scale_a=scale, scale_b=self.one, out_dtype=torch.float32)
        out = (out * self.scales[:, 0]).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        groups = self.scales.shape[1]
        values = self.weight.to(torch.float32).reshape(self.out_features, groups, -1)
        return (values * self.scales[..., None]).reshape(self.out_features, self.in_features).to(dtype)
