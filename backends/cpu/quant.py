"""Kernel modules for quantized weights on the CPU (`--quantize int8 | int4 | gguf`).

prepare_model swaps every core Linear that holds a QuantizedWeight (core/quant) for one of
these; each has Linear's contract (x [N, in] -> [N, out], float32 or bfloat16 in and out) and
traces under torch.compile (aten ops; the C++ op has a fake implementation).

- ggml block formats (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k: GGUF, and the q4_1 blocks
  --quantize int4 makes): `BlockLinear`, csrc/block_matmul.cpp over the weight repacked once
  into 16-row tiles (block_pack.py; still 4-8 bits a weight), multiplied in integers against
  activations rounded to int8 per 32 values (llama.cpp's q8_0 activations), for every step
  alike: decodes, prompt chunks and verify rows take the same arithmetic, so a request's tokens
  do not depend on the batch, and no float copy of a weight is made. Loops: AMX tiles (steps of
  16 rows or more), AVX512-VNNI, AVX2, or portable C++ (other CPUs, and `--cpu-isa portable`),
  each built for the level the engine runs at (extension.py ISA_LEVELS). Without a compiler,
  q4 weights go through torch's int4 CPU kernel (`Int4Linear`, `_weight_int4pack_mm_for_cpu`,
  groups of 32), which dequantizes w = (q - 8) * scale + zero: q4_1's w = d*q + m is scale d,
  zero m + 8d; q4_0's w = d*(q - 8) is scale d, zero 0; other formats are dequantized, with
  the reason logged.
- int8 (per output channel): `_weight_int8pack_mm`.
Both torch kernels run in bfloat16 (scales in bf16; float32 activations are cast for the
call): their float32 versions were 70x (int4) and 10x (int8) slower here at one row. Batches of
more than `batch_rows` rows go through a oneDNN-packed bf16 copy of their dequantized weight
(torch's int4/int8 CPU kernels do not tile over rows: 32 rows of the default model's linears,
int4 7x, int8 4x slower than packed bf16); batch_rows=None keeps none.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from switchyard.core.layers import Linear
from switchyard.core.layers.linear import float_weight
from switchyard.core.memory import MappedWeightPages
from switchyard.core.quant import BLOCK, BLOCK_BYTES, BLOCK_WEIGHTS, QuantizedWeight
from switchyard.core.quant.parts import QuantizedParts

from .block_pack import pack_blocks
from .extension import BLOCK_SOURCE, ExtensionBuild, build_extension, register_fake_once
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
    """The common part: bias, the batch path, and the bf16 round trip. Batches of more than
    `batch_rows` rows (None: never) go through `multiply_batch`: here a oneDNN-packed bf16 copy of
    the dequantized weight, kept beside the quantized one (torch's int4 / int8 kernels)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, batch_rows: int | None,
                 keep_batch_copy: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = weight.format
        self.bias = bias
        self.batch_rows = batch_rows
        # act-order weights (core/quant/hub): x's columns are put in the weight's order first
        self.register_buffer("input_order", getattr(weight, "input_order", None), persistent=False)
        self.batch = None
        if keep_batch_copy and batch_rows is not None and torch.bfloat16 in packable_dtypes():
            self.batch = PackedLinear(weight.dequantize(torch.bfloat16), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        limit = self.row_limit()
        out = self.multiply_batch(x) if limit is not None and x.shape[0] > limit else None
        if out is None:
            out = self.multiply(x)
        return out if self.bias is None else out + self.bias

    def row_limit(self) -> int | None:
        """Rows past which a call takes `multiply_batch` (None: never)."""
        return self.batch_rows

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def multiply_batch(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.batch is None else self.batch(x.to(torch.bfloat16)).to(x.dtype)

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


class BlockLinear(QuantizedLinear):
    """A block-format weight (or a fused weight's parts in their formats) repacked into
    csrc/block_matmul.cpp's tiles (block_pack.py), multiplied in integers whatever the number of
    rows: a prompt chunk, a decode and a verify row take one arithmetic (activations rounded to
    int8 per 32 values, exact integer dots, the same float steps per output row), so a row's
    output does not depend on the rows beside it (batch invariance) and no float copy of the
    weight is ever made. `passes`: 2 also multiplies what rounding the activations to int8 lost
    (ACTIVATION_PASSES: ~15-bit activations), 1 is llama.cpp's int8 alone. `ops`: the loaded
    extension's namespace (fake implementations registered)."""

    def __init__(self, weight: QuantizedWeight | QuantizedParts, ops, bias: torch.Tensor | None = None,
                 passes: int = 2):
        super().__init__(weight, bias, None, keep_batch_copy=False)
        packed = pack_blocks(weight.parts if isinstance(weight, QuantizedParts) else weight, ops)
        self.register_buffer("packed", packed.data, persistent=False)
        self.register_buffer("segments", packed.segments, persistent=False)
        self.ops, self.passes = ops, passes

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.block_mm(x, self.packed, self.segments, self.out_features, self.passes)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.format}, integer kernel, "
                f"{ACTIVATIONS_BY_PASSES[self.passes]} activations")


# EngineConfig.quantized_activations -> block_mm's passes: "int8x2" rounds the activations to
# int8 per 32 values and then what that lost the same way (two integer products, ~15 bits; the
# default: the default model's answers then match its dequantized float reference, where int8
# alone, as llama.cpp multiplies, changed them); "int8" is llama.cpp's one pass.
ACTIVATION_PASSES = {"int8x2": 2, "int8": 1}
ACTIVATIONS_BY_PASSES = {passes: name for name, passes in ACTIVATION_PASSES.items()}
# "auto": two passes for a model whose linear layers hold fewer weights than this, one above.
# Measured (2-core Zen 4; docs/cpu.md): on the default 135M model one pass turns the README's
# answer wrong on every ISA level, while the second pass costs a c=1 decode ~20% at the AVX2
# level (a small model's step is mostly not its products); on a 1.7B Q4_K_M the second pass
# costs 1.6x (AVX512-VNNI) to 1.9x (AVX2) a c=8 step and 1.8x a c=1 step at AVX2, and one pass
# is llama.cpp's own arithmetic, its KL to the float reference at or below llama.cpp's.
TWO_PASS_MAX_WEIGHTS = 500_000_000


def linear_weights(model: nn.Module, shards: int = 1) -> int:
    """How many weights the model's linear layers hold (a quantized one's too), the whole model's
    when it is split over `shards` shards (each holds about 1/shards of every linear)."""
    return shards * sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear))


def resolve_activations(setting: str, weights: int) -> str:
    """EngineConfig.quantized_activations with "auto" decided (TWO_PASS_MAX_WEIGHTS): the same
    choice for a model on every CPU and ISA level, so that its answers do not change with them."""
    if setting != "auto":
        return setting
    return "int8x2" if weights < TWO_PASS_MAX_WEIGHTS else "int8"


def load_block_kernel(cache_root: str, source: str = BLOCK_SOURCE, isa: str = "auto") -> ExtensionBuild:
    """Builds (or reuses) the block-format matmul and registers its fake implementation (torch.compile)."""
    build = build_extension(cache_root, source, "CPU block-format matmul",
                            "q4 weights through torch's int4 kernel, q8_0 dequantized", ("block_mm",), isa)
    register_fake_once(build, "block_mm",
                       lambda x, packed, segments, out_features, passes=1: x.new_empty((x.shape[0], out_features)))
    register_fake_once(build, "block_dequantize", lambda packed, segments, out_features, in_features, dtype:
                       packed.new_empty((out_features, in_features), dtype=dtype))
    return build


def block_formatted(weight: QuantizedWeight | QuantizedParts) -> bool:
    """Whether the block kernel multiplies `weight` (every part in a ggml block format)."""
    parts = weight.parts if isinstance(weight, QuantizedParts) else (weight,)
    return all(part.format in BLOCK_WEIGHTS for part in parts)


def kernel_module(weight: QuantizedWeight | QuantizedParts, bias: torch.Tensor | None, block_ops,
                  batch_rows: int | None, passes: int = 2) -> nn.Module | None:
    """The kernel module of one weight, or None when this CPU has none for its format."""
    if block_ops is not None and block_formatted(weight):
        return BlockLinear(weight, block_ops, bias, passes)
    if isinstance(weight, QuantizedParts):
        return None
    if weight.format in INT4_FORMATS:
        return Int4Linear(weight, bias, batch_rows)
    if weight.format == "int8":
        return Int8Linear(weight, bias, batch_rows)
    if weight.format in SCALED_KERNELS:
        return scaled_kernel(weight, bias, batch_rows)
    return None


@torch.inference_mode()
def pack_quantized(model: nn.Module, blocks: ExtensionBuild | None, batch_rows: int | None,
                   activations: str = "int8x2") -> int:
    """Replaces every Linear that holds a QuantizedWeight by its kernel module (returns how
    many); a weight with no kernel here is dequantized into the Linear's float weight (which
    pack_linears then packs), with one logged reason per format."""
    block_ops = blocks.ops if blocks is not None and blocks.available else None
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, Linear) and module.quantized is not None]
    if block_ops is not None and any(block_formatted(module.quantized) for _, module in targets):
        amx_rows, isa = block_ops.block_mm_amx_rows(), block_ops.block_mm_isa()
        logger.info("block-format weights: integer kernel %s, %s activations%s%s", isa, activations,
                    f", AMX tiles for steps of {amx_rows} rows or more" if amx_rows else "",
                    ": this CPU (or the level asked) has neither AVX2 nor AVX512-VNNI, so the plain C++ loop "
                    "multiplies them, correct but slow" if isa == "portable" else "")
    dequantized: set[str] = set()
    mapped, packed = MappedWeightPages(), 0
    # `targets` keeps each replaced Linear (and a fused projection's copied blocks) until the end.
    # Freeing them as the loop goes lowered a 7B file's load peak by 2 GB more, but its decode
    # steps ran 8-10% slower (ITL 245-251 against 227 ms, 2-core AMX Xeon): the tiles then reuse
    # the freed heap instead of fresh mappings. Each weight's file pages are dropped once it is
    # packed: that costs nothing.
    for name, module in targets:
        weight, bias = module.quantized, None if module.bias is None else module.bias.detach()
        kernel = kernel_module(weight, bias, block_ops, batch_rows, ACTIVATION_PASSES[activations])
        if kernel is None:
            module.weight = nn.Parameter(float_weight(weight, module.weight.dtype), requires_grad=False)
            module.quantized = None
            if weight.format not in dequantized:
                reason = blocks.reason if blocks is not None and blocks.reason else "no CPU kernel"
                logger.warning("%s weights dequantized to %s: %s", weight.format, module.weight.dtype, reason)
                dequantized.add(weight.format)
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, kernel)
            packed += 1
        for part in weight.parts if isinstance(weight, QuantizedParts) else (weight,):
            mapped.drop(part.data)  # repacked or dequantized: the file pages it read leave the resident set
    return packed


# core/quant/scaled.py's formats: their kernel modules' files (bnb_linear.py: bitsandbytes' own ops;
# fp8_linear.py: csrc/fp8_matmul.cpp), imported on first use; each factory may return None.
SCALED_KERNELS = {"bnb_nf4": "bnb_linear:bnb_kernel", "bnb_fp4": "bnb_linear:bnb_kernel",
                  "bnb_int8": "bnb_linear:bnb_kernel", "fp8_e4m3": "fp8_linear:fp8_kernel"}


def scaled_kernel(weight: QuantizedWeight, bias: torch.Tensor | None, batch_rows: int | None) -> nn.Module | None:
    import importlib

    module, factory = SCALED_KERNELS[weight.format].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), factory)(weight, bias, batch_rows)
