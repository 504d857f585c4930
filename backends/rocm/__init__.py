"""ROCm backend: a HIP build of torch drives AMD GPUs through the torch.cuda API, so this
backend is the CUDA backend (same Triton kernels, same graph runner, same launcher)
with its own probe; FEATURE_DIFFERENCES lists what differs."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from typing import ClassVar

import torch

from switchyard.backends.cuda.backend import CudaBackend
from switchyard.core.backend import AttentionKernel, AttentionSpec, Capabilities, ProbeResult

# What differs from the CUDA backend, printed by `switchyard backends` (attention_impl) and in the README.
FEATURE_DIFFERENCES = (
    "attention: Triton paged attention only; flash-attn's ROCm build is not used (its paged-KV "
    "support differs from upstream's)",
    "graphs: torch.cuda graphs on HIP (hipGraph); same decode buckets",
    "collectives: RCCL, through torch.distributed's 'nccl' backend name",
    "devices: HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, as the HIP runtime reads them",
    "dtypes: bf16 needs a GPU with bf16 support (MI200 and newer); fp16 and fp32 everywhere",
    "quantization: what the Triton dequantize-GEMM multiplies (GGUF blocks, int8 / int4 at load, GPTQ, AWQ, "
    "compressed-tensors int, eetq; core/quant/methods.py lists rocm for them); no Marlin, no fp8 "
    "(torch._scaled_mm's e4m3fn is not ROCm's float8), no bitsandbytes",
)
ROCM_ATTENTION_IMPL = "triton paged attention on HIP (flash-attn not used on ROCm)"


def probe_rocm() -> ProbeResult:
    """Usable when torch is a HIP build, a device is visible and Triton is installed; no context."""
    try:
        hip = getattr(torch.version, "hip", None)
        if hip is None:
            return ProbeResult(False, f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)")
        if not torch.cuda.is_available():
            shown = {k: os.environ[k] for k in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if k in os.environ}
            where = "".join(f"; {k}={v!r}" for k, v in shown.items())
            return ProbeResult(False, f"no ROCm device visible (torch.cuda.is_available() is False{where})")
        if importlib.util.find_spec("triton") is None:
            return ProbeResult(False, "triton is not installed (pip install 'switchyard[rocm]')")
        count = torch.cuda.device_count()
        return ProbeResult(True, f"{count} ROCm device{'s' if count != 1 else ''} visible "
                                 f"(torch {torch.__version__}, HIP {hip})")
    except Exception as error:
        return ProbeResult(False, f"probing ROCm failed: {type(error).__name__}: {error}")


class RocmBackend(CudaBackend):
    name = "rocm"
    priority = 90
    planned_attention_impl: ClassVar[str] = ROCM_ATTENTION_IMPL
    feature_differences: ClassVar[tuple[str, ...]] = FEATURE_DIFFERENCES

    @classmethod
    def probe(cls) -> ProbeResult:
        return probe_rocm()

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), attention_impl=ROCM_ATTENTION_IMPL)

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        from switchyard.backends.cuda.backend import triton_attention

        return triton_attention(spec)


__all__ = ["FEATURE_DIFFERENCES", "RocmBackend", "probe_rocm"]
