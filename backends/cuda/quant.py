"""Quantized weights on the CUDA backend (and ROCm's, for what its Triton runs): prepare_model swaps
every core Linear that holds a QuantizedWeight or QuantizedParts (core/quant) for a kernel module,
its weight repacked once onto the GPU in that kernel's layout; no float copy is kept.

Which kernel serves a weight is decided in one place, `choose_kernel`, and logged once per format:
- ggml block formats (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k: GGUF files, and what core/quant/hub
  makes of GPTQ, AWQ and compressed-tensors checkpoints) and "int8" (--quantize int8 / eetq, the int4
  head, GPTQ 8-bit per channel; its codes signed): `TritonQuantLinear`, the Triton dequantize-GEMM
  (kernels/dequant_gemm.py) over the layout of packed_codes.py (affine_blocks' w = d * u + c, groups
  coarsened back to the checkpoint's own). A fused weight's parts (QuantizedParts: Q4_K_M's q/k in
  Q4_K and v in Q6_K) are one GEMM per run of parts of one layout, outputs side by side.
- symmetric 4-bit weights (q4_0) in groups of 128 or one per row (GPTQ / compressed-tensors W4A16,
  the scales repeated by core in each 32-weight block) with fp16/bf16 activations on an NVIDIA sm80+
  GPU where vLLM or gptqmodel is installed: `MarlinLinear` (marlin.py).
- fp8_e4m3: `CudaFp8Linear` (fp8_linear.py; torch._scaled_mm where the GPU has fp8).
- bnb_nf4, bnb_fp4, bnb_int8: bitsandbytes' own CUDA ops (bnb_linear.py); without bitsandbytes the
  weight is dequantized into the Linear's float weight (one logged line).
Act-order weights (GPTQ desc_act) have x's columns put in the weight's order first (quant_linear.py).
A quantized Embedding (a GGUF's token table) keeps its blocks; they move to the device, and only the
looked-up rows are dequantized (core's Embedding.forward).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from switchyard.core.layers import Linear
from switchyard.core.layers.linear import Embedding, float_weight
from switchyard.core.quant import BLOCK_BYTES, QuantizedWeight, affine_blocks
from switchyard.core.quant.parts import QuantizedParts

from ..bnb_ops import import_bnb
from .bnb_linear import CudaBnb4bitLinear, CudaBnbInt8Linear
from .fp8_linear import CudaFp8Linear, tensorwise_reason
from .marlin import MarlinApi, MarlinLinear, find_marlin, marlin_refusal
from .packed_codes import PackedCodes, concat_columns, pack_codes
from .quant_linear import CudaQuantLinear

logger = logging.getLogger(__name__)

TRITON_FORMATS = (*BLOCK_BYTES, "int8")
BNB_FORMATS = ("bnb_nf4", "bnb_fp4", "bnb_int8")
KINDS = ("triton", "marlin", "fp8", "bitsandbytes", "dequantized")


@dataclass(frozen=True)
class KernelTarget:
    """Where the weights go: the device, the model's activation dtype, the GPU's compute capability
    (None: not an NVIDIA GPU: ROCm, or the CPU of the tests) and the Marlin package found (or None)."""

    device: torch.device
    dtype: torch.dtype
    capability: tuple[int, int] | None = None
    marlin: MarlinApi | None = None

    @classmethod
    def of(cls, device: torch.device, dtype: torch.dtype) -> KernelTarget:
        nvidia = device.type == "cuda" and not getattr(torch.version, "hip", None)
        capability = torch.cuda.get_device_capability(device) if nvidia else None
        return cls(device, dtype, capability, find_marlin() if nvidia else None)


@dataclass(frozen=True)
class KernelChoice:
    kind: str  # one of KINDS
    reason: str  # one line for the start log

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kernel kind {self.kind!r} is not one of {KINDS}")


def affine_form(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(u [N, K], d, c float32 [N, K / group], group, bits) of a Triton-format weight, on its data's
    device: affine_blocks for the ggml formats (u uint8); int8 per channel as its signed codes
    (u int8, c = 0: w = d * q, rounded once, as core's dequantization)."""
    out, inp = weight.shape
    if weight.format == "int8":
        d = weight.scales.float().reshape(out, 1)
        return weight.data, d, torch.zeros_like(d), inp, 8
    blocks = affine_blocks(weight)
    return blocks.u.reshape(out, inp), blocks.d, blocks.c, blocks.group, blocks.bits


def pack_weight(weight: QuantizedWeight | QuantizedParts, device: torch.device) -> list[PackedCodes]:
    """The weight in the Triton GEMM's layout on `device`: one PackedCodes per run of consecutive
    parts that share a format (a QuantizedWeight is one run); runs whose packs came out in one
    layout are joined too."""
    parts = weight.parts if isinstance(weight, QuantizedParts) else (weight,)
    runs: list[list[QuantizedWeight]] = []
    for part in parts:
        if runs and runs[-1][0].format == part.format:
            runs[-1].append(part)
        else:
            runs.append([part])
    packs: list[PackedCodes] = []
    for run in runs:
        forms = [affine_form(replace(part, data=part.data.to(device),
                                     scales=None if part.scales is None else part.scales.to(device)))
                 for part in run]
        u, d, c = (torch.cat([form[i] for form in forms]) for i in range(3))
        pack = pack_codes(u, d, c, forms[0][3], forms[0][4])
        if packs and (packs[-1].bits, packs[-1].group, packs[-1].scales.dtype) == \
                (pack.bits, pack.group, pack.scales.dtype):
            pack = concat_columns([packs.pop(), pack])
        packs.append(pack)
    return packs


def choose_kernel(weight: QuantizedWeight | QuantizedParts, target: KernelTarget,
                  packs: list[PackedCodes] | None = None) -> KernelChoice:
    """The one decision of which kernel multiplies `weight` on `target`, and why. packs: the weight
    in the Triton layout (pack_weight), for the formats that have one (Marlin's test reads them)."""
    if isinstance(weight, QuantizedParts):
        return KernelChoice("triton", "Triton dequantize-GEMM, one per run of parts in one layout")
    fmt = weight.format
    if fmt == "fp8_e4m3":
        why = tensorwise_reason(weight, target.device)
        return KernelChoice("fp8", "torch._scaled_mm (fp8 activations, per-channel weight scales)" if why is None
                            else f"fp8 weights dequantized per call into the activations' dtype: {why}")
    if fmt in BNB_FORMATS:
        if import_bnb() is None:
            return KernelChoice("dequantized", "bitsandbytes is not installed (pip install bitsandbytes)")
        return KernelChoice("bitsandbytes", "bitsandbytes' own CUDA ops" +
                            (" (LLM.int8 syncs with the host: no CUDA graphs)" if fmt == "bnb_int8" else ""))
    if fmt not in TRITON_FORMATS:
        return KernelChoice("dequantized", f"no CUDA kernel for {fmt} weights")
    pack = packs[0] if packs else None
    layout = (f"{pack.bits}-bit codes, groups of {pack.group}, {str(pack.scales.dtype).removeprefix('torch.')} "
              f"scales" if pack is not None else fmt)
    if fmt == "q4_0" and pack is not None:  # symmetric 4-bit: w = d * (u - 8)
        refusal = marlin_refusal(pack, True, target.dtype, target.capability, target.marlin)
        if refusal is None:
            return KernelChoice("marlin", f"Marlin ({target.marlin.source}): {layout}")
        return KernelChoice("triton", f"Triton dequantize-GEMM ({layout}); not Marlin: {refusal}")
    return KernelChoice("triton", f"Triton dequantize-GEMM ({layout})")


class TritonQuantLinear(CudaQuantLinear):
    """The Triton dequantize-GEMM over one weight's packs (one per run of parts of one layout)."""

    def __init__(self, packs: list[PackedCodes], fmt: str, bias: torch.Tensor | None,
                 input_order: torch.Tensor | None, device: torch.device):
        from .kernels.dequant_gemm import dequant_gemm  # triton: imported when a kernel is built

        out = sum(pack.shape[0] for pack in packs)
        super().__init__(out, packs[0].shape[1], fmt, bias, input_order, device)
        self._gemm = dequant_gemm
        self.layouts = [(pack.bits, pack.group) for pack in packs]
        for i, pack in enumerate(packs):
            for field in ("codes", "scales", "offsets"):
                self.register_buffer(f"{field}{i}", getattr(pack, field).to(device), persistent=False)
        self.kernel = "Triton dequantize-GEMM (" + "; ".join(
            f"{bits}-bit codes, groups of {group}" for bits, group in self.layouts) + ")"

    def packs(self) -> list[PackedCodes]:
        return [PackedCodes(getattr(self, f"codes{i}"), getattr(self, f"scales{i}"), getattr(self, f"offsets{i}"),
                            bits, group) for i, (bits, group) in enumerate(self.layouts)]

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        outs = [self._gemm(x, pack) for pack in self.packs()]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def kernel_module(weight: QuantizedWeight | QuantizedParts, bias: torch.Tensor | None,
                  target: KernelTarget) -> tuple[CudaQuantLinear | None, KernelChoice]:
    """The kernel module of one weight on `target` (None: no kernel; the caller dequantizes), and the choice."""
    packs = pack_weight(weight, target.device) if isinstance(weight, QuantizedParts) or \
        weight.format in TRITON_FORMATS else None
    choice = choose_kernel(weight, target, packs)
    order = weight.input_order if isinstance(weight, QuantizedWeight) else None
    if choice.kind == "triton":
        return TritonQuantLinear(packs, weight.format, bias, order, target.device), choice
    if choice.kind == "marlin":
        return MarlinLinear(packs[0], weight.format, bias, order, target.dtype, target.device, target.marlin), choice
    if choice.kind == "fp8":
        return CudaFp8Linear(weight, bias, target.device), choice
    if choice.kind == "bitsandbytes":
        linear = CudaBnbInt8Linear if weight.format == "bnb_int8" else CudaBnb4bitLinear
        return linear(weight, bias, target.device), choice
    return None, choice


def has_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (Linear, Embedding)) and m.quantized is not None for m in model.modules())


@torch.inference_mode()
def pack_quantized(model: nn.Module, target: KernelTarget) -> dict[str, int]:
    """Swaps every Linear holding a quantized weight for its kernel module and moves quantized
    embeddings to the device; a weight with no kernel is dequantized into the Linear's float
    weight. Logs each format's choice once (per kind of kernel it gets: a layer Marlin cannot take
    goes to Triton); returns how many linears each kind of kernel took."""
    counts: dict[str, int] = {}
    logged: set[tuple[str, str]] = set()  # (format, kind): a format's first reason for each kernel it takes
    for name, module in list(model.named_modules()):
        if isinstance(module, Embedding) and module.quantized is not None:
            q = module.quantized
            module.quantized = replace(q, data=q.data.to(target.device),
                                       scales=None if q.scales is None else q.scales.to(target.device))
            continue
        if not isinstance(module, Linear) or module.quantized is None:
            continue
        weight, bias = module.quantized, None if module.bias is None else module.bias.detach()
        kernel, choice = kernel_module(weight, bias, target)
        if (weight.format, choice.kind) not in logged:
            logged.add((weight.format, choice.kind))
            logger.info("%s weights: %s", weight.format, choice.reason if kernel is not None
                        else f"dequantized to {module.weight.dtype}: {choice.reason}")
        counts[choice.kind] = counts.get(choice.kind, 0) + 1
        if kernel is None:
            module.weight = nn.Parameter(float_weight(weight, module.weight.dtype).to(target.device),
                                         requires_grad=False)
            module.quantized = None
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, kernel)
    return counts
