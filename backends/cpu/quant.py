"""Kernel modules for quantized weights on the CPU (`--quantize int8 | int4 | gguf`).

prepare_model swaps every core Linear that holds a QuantizedWeight (core/quant) for one of
these; each has Linear's contract (x [N, in] -> [N, out], float32 or bfloat16 in and out) and
traces under torch.compile (aten ops; the C++ op has a fake implementation).

- q4_0 / q4_1 (GGUF, and what --quantize int4 makes): torch's int4 CPU kernel
  (`_weight_int4pack_mm_for_cpu`, groups of 32), which dequantizes w = (q - 8) * scale + zero:
  q4_1's w = d*q + m is scale d, zero m + 8d; q4_0's w = d*(q - 8) is scale d, zero 0.
- int8 (per output channel): `_weight_int8pack_mm`.
- q8_0 (GGUF; the default model's tied embedding/lm_head): csrc/q8_0_matmul.cpp, blocks as the
  file has them. Without a compiler the weight is dequantized, with the reason logged.
Both torch kernels run in bfloat16 (scales in bf16; float32 activations are cast for the
call): their float32 versions were 70x (int4) and 10x (int8) slower here at one row.

Batches of more than `batch_rows` rows go through a oneDNN-packed bf16 copy of the
dequantized weight instead: torch's int4/int8 CPU kernels do not tile over rows (32 rows
of the default model's linears: int4 7x, int8 4x slower than packed bf16 on an AMX Xeon).
That copy costs 2 bytes per weight on top of the packed ones; batch_rows=None keeps none.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from switchyard.core.layers import Linear
from switchyard.core.quant import BLOCK, BLOCK_BYTES, QuantizedWeight

from .extension import Q8_0_SOURCE, ExtensionBuild, build_extension
from .linear import PackedLinear, packable_dtypes

logger = logging.getLogger(__name__)

INT4_FORMATS = ("q4_0", "q4_1")
INNER_K_TILES = 2  # the int4 pack's tiling (2, 4 or 8 all divide the 576-wide default model)
INT4_ROWS = 16  # the int4 pack wants a multiple of 16 output rows; others are padded


def int4_operands(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int4 weight, bf16 scales_and_zeros [in / 32, out padded, 2]) of a q4_0 / q4_1 weight."""
    out, inp = weight.shape
    blocks = weight.data.view(out, inp // BLOCK, BLOCK_BYTES[weight.format])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    head = 2 if weight.format == "q4_0" else 4
    qs = blocks[..., head:].to(torch.int32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(out, inp)
    zero = (torch.zeros_like(d) if weight.format == "q4_0"
            else blocks[..., 2:4].contiguous().view(torch.float16).float() + 8 * d)
    pad = -out % INT4_ROWS  # padding rows: scale 0, zero 0, so they output 0 (cut off after the call)
    q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    scales_and_zeros = torch.nn.functional.pad(torch.cat([d, zero], dim=-1), (0, 0, 0, 0, 0, pad))
    scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INNER_K_TILES)
    return packed, scales_and_zeros


class QuantizedLinear(nn.Module):
    """The common part: bias, the batch path, and the bf16 round trip."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, batch_rows: int | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = weight.format
        self.bias = bias
        self.batch_rows = batch_rows
        self.batch = None
        if batch_rows is not None and torch.bfloat16 in packable_dtypes():
            self.batch = PackedLinear(weight.dequantize(torch.bfloat16), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch is not None and x.shape[0] > self.batch_rows:
            out = self.batch(x.to(torch.bfloat16)).to(x.dtype)
        else:
            out = self.multiply(x)
        return out if self.bias is None else out + self.bias

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        batch = f", batches over {self.batch_rows} rows: bf16 oneDNN" if self.batch is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format}{batch}"


class Int4Linear(QuantizedLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, batch_rows: int | None = None):
        super().__init__(weight, bias, batch_rows)
        packed, scales_and_zeros = int4_operands(weight)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, BLOCK,
                                                          self.scales_and_zeros)
        if out.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        return out.to(x.dtype)


class Int8Linear(QuantizedLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, batch_rows: int | None = None):
        super().__init__(weight, bias, batch_rows)
        self.register_buffer("qweight", weight.data.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.to(torch.bfloat16), persistent=False)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)


class Q8_0Linear(QuantizedLinear):
    """`ops`: the loaded q8_0_matmul extension's namespace (fake implementation registered)."""

    def __init__(self, weight: QuantizedWeight, ops, bias: torch.Tensor | None = None, batch_rows: int | None = None):
        super().__init__(weight, bias, batch_rows)
        self.register_buffer("blocks", weight.data.contiguous(), persistent=False)
        self.ops = ops

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.q8_0_mm(x, self.blocks, self.out_features)


_FAKES: set[str] = set()


def load_q8_0_kernel(cache_root: str, source: str = Q8_0_SOURCE) -> ExtensionBuild:
    """Builds (or reuses) the Q8_0 matmul and registers its fake implementation (torch.compile)."""
    build = build_extension(cache_root, source, "CPU Q8_0 matmul", "Q8_0 weights dequantized", ("q8_0_mm",))
    if build.available and build.name not in _FAKES:
        @torch.library.register_fake(f"{build.name}::q8_0_mm")
        def _fake(x, blocks, out_features):
            return x.new_empty((x.shape[0], out_features))
        _FAKES.add(build.name)
    return build


def kernel_module(weight: QuantizedWeight, bias: torch.Tensor | None, q8_0_ops, batch_rows: int | None) -> nn.Module | None:
    """The kernel module of one weight, or None when this CPU has none for its format."""
    if weight.format in INT4_FORMATS:
        return Int4Linear(weight, bias, batch_rows)
    if weight.format == "int8":
        return Int8Linear(weight, bias, batch_rows)
    if weight.format == "q8_0" and q8_0_ops is not None:
        return Q8_0Linear(weight, q8_0_ops, bias, batch_rows)
    return None


@torch.inference_mode()
def pack_quantized(model: nn.Module, q8_0: ExtensionBuild | None, batch_rows: int | None) -> int:
    """Replaces every Linear that holds a QuantizedWeight by its kernel module (returns how
    many); a weight with no kernel here is dequantized into the Linear's float weight (which
    pack_linears then packs), with one logged reason per format."""
    q8_0_ops = q8_0.ops if q8_0 is not None and q8_0.available else None
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, Linear) and module.quantized is not None]
    dequantized: set[str] = set()
    for name, module in targets:
        weight, bias = module.quantized, None if module.bias is None else module.bias.detach()
        kernel = kernel_module(weight, bias, q8_0_ops, batch_rows)
        if kernel is None:
            module.weight = nn.Parameter(weight.dequantize(module.weight.dtype), requires_grad=False)
            module.quantized = None
            if weight.format not in dequantized:
                reason = q8_0.reason if weight.format == "q8_0" and q8_0 is not None else "no CPU kernel"
                logger.warning("%s weights dequantized to %s: %s", weight.format, module.weight.dtype, reason)
                dequantized.add(weight.format)
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, kernel)
    return len(targets) - sum(1 for _, m in targets if m.quantized is None)
