"""Linear layers with weights reordered by oneDNN for this CPU.

`torch.ops.mkldnn._reorder_linear_weight` lays a weight out in the blocked format
oneDNN's matmul wants (the same prepacking torch.compile's freezing pass does), so
each step reads it at close to memory bandwidth instead of repacking it on the fly.
SmolLM2-135M on a 2-core AVX-512 EPYC, all linears of one decode step (torch 2.13):
bf16 8.3 ms packed vs 12.5 ms F.linear at 1 row, 16.6 vs 21.8 ms at 32 rows; float32
25.7 vs 35.8 ms at 1 row, 29.6 vs 96.9 ms at 32 rows. Results are bit-identical in
bf16 and within float32 rounding in float32.

The packing hint matters for float32 (a weight packed for many rows runs one row 4x
slower, and the other way round), so float32 keeps two packings; bf16 keeps one packed for 64
rows where that serves one row as fast (see BF16_BATCH_HINT).
Packing replaces the plain weight (no second copy), except a weight shared with
another module (a tied lm_head) stays where it is.

Where oneDNN packs float32 but not bf16 (AVX2 CPUs: no AVX-512, so no bf16 arithmetic), a bf16
weight is packed as float32 (the same values, exactly) and multiplied in float32, its output
rounded to bf16: what a bf16 matmul with float32 accumulation computes, at float32's speed.
Unpacked, torch's bf16 matmul there converts on every call: SmolLM2-135M on a 2-core AVX2 EPYC,
a 32-row decode step 650 ms in bf16 against 210 ms in float32. Steps of up to
ROWS_BESIDE_FLOAT32 rows, bound by memory bandwidth, then multiply the bf16 weight itself with
csrc/row_matmul.h's kernel (2 bytes read per weight instead of 4; repacked by pack_rows); the
float32 packing serves batches. 6 bytes per weight in all.

Where oneDNN packs bf16 but reads a single row slowly (AVX-512 without AMX), steps of up to
ROWS_BESIDE_BF16 rows take the row kernel too, beside the bf16 packing: 4 bytes per weight, so
the backend asks for it only where that copy fits (backend.prepare_model).
"""
from __future__ import annotations

from functools import cache

import torch
from torch import nn

from switchyard.core.layers import Linear

from .extension import ROWS_SOURCE, ExtensionBuild, build_extension, register_fake_once
from .tuning import best_seconds

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN can pack on this CPU: bf16 packing needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT, which an AVX2-only CPU lacks (there bf16 weights stay unpacked)."""
    if not packing_supported():
        return ()
    return PACKABLE_DTYPES if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def packing_supported() -> bool:
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


# The batch size oneDNN is told to pack bf16 weights for. Idle 2-core AMX Xeon, the default
# model's 30 layers of linears (torch 2.13), packed for 1 row / for 64 rows: 14.0 / 12.5 ms at
# 1 row, 13.1 / 12.4 at 16, 19.4 / 16.8 at 64, 25.3 / 23.0 at 128. Where a 64-row packing runs
# one row slower than a 1-row packing (bf16_packing_hint measures it once), bf16 keeps both.
BF16_BATCH_HINT = 64


# Rows up to which the bf16 row kernel multiplies a bf16 weight instead of oneDNN (rows_kernel_rows).
# Packed as float32 (no bf16 packing): 2-core AVX2 EPYC (Zen 3), the default model's 120 layer
# linears with distinct weights (torch 2.13), row kernel / float32 oneDNN packed for batches, best
# of 5 interleaved: 9.9 / 28.7 ms at 1 row, 17.5 / 37.9 at 4, 28.8 / 37.5 at 8, 40.1 / 42.4 at 12,
# 50.6 / 51.0 at 16 (each input row past the first re-reads the weights from L1: compute-bound).
ROWS_BESIDE_FLOAT32 = 8
# Beside a bf16 packing: 2-core AVX-512 BF16 EPYC (Zen 4, no AMX), the same linears, row kernel /
# oneDNN bf16 packed for 64 rows, best of 10, three rounds: 8.2 / 14.7 ms at 1 row, 10.8 / 14.1
# at 2, 14.8 / 11.4 at 4, 25.0 / 14.3 at 8.
ROWS_BESIDE_BF16 = 2

ROWS_TILE = (4, 32)  # csrc/row_matmul.h's tile: weight rows x columns


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] in the row kernel's layout: [N' / 4, K' / 32, 4, 32], N and K
    zero-padded to multiples of 4 and 32, each tile's 4 rows of 32 columns contiguous."""
    rows, columns = ROWS_TILE
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -k % columns, 0, -n % rows))
    n, k = padded.shape
    return padded.view(n // rows, rows, k // columns, columns).permute(0, 2, 1, 3).contiguous()


def rows_kernel_rows(dtype: torch.dtype) -> int:
    """Up to how many rows of a step the bf16 row kernel multiplies weights of this dtype on this
    CPU: ROWS_BESIDE_FLOAT32 where bf16 is packed as float32, ROWS_BESIDE_BF16 beside a bf16
    packing; 0 where it does not serve (not bf16, or nothing packs)."""
    dtypes = packable_dtypes()
    if dtype != torch.bfloat16 or torch.float32 not in dtypes:
        return 0
    return ROWS_BESIDE_BF16 if torch.bfloat16 in dtypes else ROWS_BESIDE_FLOAT32


def load_rows_kernel(cache_root: str, isa: str = "auto") -> ExtensionBuild:
    """Builds (or reuses) the bf16 row kernel (csrc/row_matmul.cpp); unavailable, with the reason,
    where it did not build or would run its portable loop (no AVX2: slower than oneDNN float32)."""
    build = build_extension(cache_root, ROWS_SOURCE, "CPU bf16 row matmul",
                            "bf16 decode steps multiply float32 copies of the weights", ("bf16_rows_mm",), isa)
    if build.available and build.ops.rows_mm_isa() == "portable":
        return ExtensionBuild(None, "no AVX2 on this CPU", build.directory, build.seconds, build.cache_hit)
    register_fake_once(build, "bf16_rows_mm",
                       lambda x, packed, out_features, bias: x.new_empty((x.shape[0], out_features)))
    return build


def describe() -> str:
    """For `switchyard backends`: how this CPU multiplies linear weights."""
    if not packing_supported():
        return "linear weights not packed (this torch has no oneDNN packing)"
    rows = rows_kernel_rows(torch.bfloat16)
    if torch.bfloat16 not in packable_dtypes():
        return (f"linear weights packed for oneDNN (bf16 as float32: no bf16 packing on this CPU; steps of up to "
                f"{rows} rows multiply the bf16 weights in the bf16 row kernel)")
    return (f"linear weights packed for oneDNN (bf16: steps of up to {rows} rows multiply a second copy of "
            f"the bf16 weights in the bf16 row kernel where it fits in memory)")


@cache
def bf16_one_packing() -> bool:
    """Whether one bf16 packing for BF16_BATCH_HINT rows also serves single rows at least about
    as fast as a packing for one row on this CPU (timed once per process, interleaved)."""
    weight = torch.randn(3072, 576).to(torch.bfloat16)
    row = torch.randn(1, 576).to(torch.bfloat16)
    packed = {hint: torch.ops.mkldnn._reorder_linear_weight(weight, hint) for hint in (1, BF16_BATCH_HINT)}
    calls = {hint: (lambda w=w: torch.ops.mkldnn._linear_pointwise(row, w, None, "none", [], ""))
             for hint, w in packed.items()}
    times = {hint: float("inf") for hint in packed}
    for _ in range(3):
        for hint, call in calls.items():
            call()  # the first call of a packing pays for page faults
            times[hint] = min(times[hint], best_seconds(call, 5))
    return times[BF16_BATCH_HINT] <= 1.1 * times[1]


class PackedLinear(nn.Module):
    """Same contract as core.layers.Linear: x [N, in_features] -> [N, out_features].
    `rows_ops`: the bf16 row kernel's namespace (load_rows_kernel); for a bf16 weight it then
    multiplies steps of up to `rows_limit` rows (rows_kernel_rows) on the bf16 weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows_ops=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.dtype = weight.dtype  # of the inputs and outputs
        self.rows_ops, self.rows_limit = None, 0
        if rows_ops is not None and rows_kernel_rows(weight.dtype) > 0:
            self.rows_ops, self.rows_limit = rows_ops, rows_kernel_rows(weight.dtype)
            self.register_buffer("_rows_weight", pack_rows(weight), persistent=False)
        if weight.dtype not in packable_dtypes():  # bf16 without bf16 packing: float32 inside
            weight = weight.float()
            bias = None if bias is None else bias.float()
        # float32: one packing for single rows, one for batches; bf16: one packed for
        # BF16_BATCH_HINT rows where it serves single rows too, else both. Buffers, so that
        # torch.compile's freezing (compiled.py) takes them as constants, as inductor's oneDNN
        # lowering requires of a packed weight.
        if weight.dtype == torch.bfloat16:
            batch = torch.ops.mkldnn._reorder_linear_weight(weight, BF16_BATCH_HINT)
            # with the row kernel, single rows never reach a one-row packing
            one_row = batch if self.rows_ops is not None or bf16_one_packing() else \
                torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            batch = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            # with the row kernel, single rows never reach a float32 packing
            one_row = batch if self.rows_ops is not None else torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.register_buffer("_packed_one_row", one_row, persistent=False)
        self.register_buffer("_packed_batch", batch, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_ops is not None and x.shape[0] <= self.rows_limit:
            return self.rows_ops.bf16_rows_mm(x, self._rows_weight, self.out_features, self.bias)
        packed = self._packed_one_row if x.shape[0] == 1 else self._packed_batch
        # .to is a no-op unless a bf16 weight was packed as float32
        return torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, self.bias, "none", [], "").to(x.dtype)

    def extra_repr(self) -> str:
        inside = "" if self._packed_one_row.dtype == self.dtype else f", multiplied in {self._packed_one_row.dtype}"
        if self.rows_ops is not None:
            inside += f" (up to {self.rows_limit} rows: bf16 row kernel)"
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed{inside}"


@torch.inference_mode()
def pack_linears(model: nn.Module, rows_ops=None) -> int:
    """Replaces every Linear of the model whose weight is in a dtype this CPU can pack
    (packable_dtypes; bf16 also where only float32 packs, see the module docstring) by a
    PackedLinear; returns how many were replaced. rows_ops: see PackedLinear."""
    dtypes = packable_dtypes()
    if torch.float32 in dtypes:
        dtypes += (torch.bfloat16,)
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, Linear) and module.quantized is None and module.weight.device.type == "cpu"
               and module.weight.dtype in dtypes]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = None if module.bias is None else module.bias.detach()
        setattr(parent, child, PackedLinear(module.weight, bias, rows_ops))
    return len(targets)
