"""Scaled-code weight formats: bitsandbytes' NF4 / FP4 / LLM.int8 and float8 e4m3. Each weight is a
code value times a float scale of its (row, group): w[r, c] = code[q[r, c]] * scales[r, c // group],
with `scales` float32 [out, groups] and group = in / groups (groups of whole columns of one row,
so rows stay self-contained: they can be permuted, sliced and concatenated like the block formats).

- "bnb_nf4", "bnb_fp4": bitsandbytes 4-bit (`bitsandbytes.functional.quantize_4bit`). `data` uint8
  [out, in / 2], bitsandbytes' own packing: byte j of a row holds weight 2j in its high half and
  2j + 1 in its low half; the code is bitsandbytes' 16-value NF4 or FP4 table (CODES, checked
  against `bitsandbytes.functional.get_4bit_type` by the tests); `scales` its absmax per block of
  `blocksize` (64) weights, the nested (double-quantized) absmax already dequantized. A block
  must lie in one row: in % blocksize == 0 (a checkpoint whose blocks straddle rows is read as floats).
- "bnb_int8": LLM.int8 rows (bitsandbytes' `int8_vectorwise_quant`): `data` int8 [out, in],
  `scales` [out, 1] its SCB (the row's absmax); w = q * SCB / 127 (code q / 127).
- "fp8_e4m3": float8 e4m3fn weights (llm-compressor / compressed-tensors FP8, and the 128x128
  block `weight_scale_inv` of DeepSeek-V3 / Qwen3 FP8 expanded to rows): `data` uint8 [out, in],
  the float8 bytes; `scales` [out, groups]: 1 group per row (per channel, or a per-tensor scale
  repeated) or in / 128 groups (blocks: each row carries its block row's scales).

The dequantization here is plain torch (the reference of the kernels in backends/); bitsandbytes is
needed only to make the bnb formats at load (weight.py `quantize_bnb`) and by the kernels that multiply them.
"""
from __future__ import annotations

import torch

SCALED_FORMATS = ("bnb_nf4", "bnb_fp4", "bnb_int8", "fp8_e4m3")
BNB_BLOCKSIZE = 64  # bitsandbytes' default 4-bit block (what TGI and transformers quantize with)
FP8_MAX = 448.0  # the largest finite float8 e4m3fn
INT8_STEP = 7.874015718698502e-3  # 1 / 127 as bitsandbytes multiplies LLM.int8 rows back

# bitsandbytes' 4-bit codes (bitsandbytes.functional.get_4bit_type): NF4's quantiles of N(0, 1)
# scaled to [-1, 1], FP4's e2m1 values over 12 (code 8 is bitsandbytes' +0.0 too).
_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0]
_FP4 = [0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]
CODES = {"bnb_nf4": torch.tensor(_NF4, dtype=torch.float32),
         "bnb_fp4": torch.tensor(_FP4, dtype=torch.float32) / 12}
QUANT_TYPES = {"bnb_nf4": "nf4", "bnb_fp4": "fp4"}  # bitsandbytes' name of each 4-bit format


def check_scaled(fmt: str, shape: tuple[int, int], data: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Raises ValueError for data or scales that do not fit `fmt` (see the module's docstring)."""
    out, inp = shape
    dtype, width = (torch.int8, inp) if fmt == "bnb_int8" else (torch.uint8, inp // 2 if fmt in CODES else inp)
    if data.dtype != dtype or tuple(data.shape) != (out, width) or (fmt in CODES and inp % 2):
        raise ValueError(f"{fmt} weight {shape} has data {tuple(data.shape)} {data.dtype}; expected {dtype} "
                         f"[{out}, {width}]")
    if scales is None or scales.dtype != torch.float32 or scales.dim() != 2 or scales.shape[0] != out \
            or scales.shape[1] == 0 or inp % scales.shape[1] or (fmt == "bnb_int8" and scales.shape[1] != 1):
        got = None if scales is None else (tuple(scales.shape), scales.dtype)
        raise ValueError(f"{fmt} weight {shape} has scales {got}; expected float32 [{out}, groups] with groups "
                         f"dividing {inp}" + (" (1 for bnb_int8)" if fmt == "bnb_int8" else ""))


def codes(fmt: str, data: torch.Tensor, inp: int) -> torch.Tensor:
    """float32 [rows, inp]: each weight's code value (before its scale)."""
    if fmt == "fp8_e4m3":
        return data.view(torch.float8_e4m3fn).float()
    if fmt == "bnb_int8":
        return data.float() * INT8_STEP
    q = torch.stack([data >> 4, data & 0x0F], dim=-1).reshape(data.shape[0], inp)  # high half first
    return CODES[fmt].to(data.device)[q.long()]


def dequantize_scaled(fmt: str, data: torch.Tensor, scales: torch.Tensor, inp: int) -> torch.Tensor:
    """float32 [rows, inp] (rows = data.shape[0])."""
    if fmt == "bnb_int8":  # in bitsandbytes' order (int8_vectorwise_dequant): q * SCB, then / 127
        return data.float() * scales * INT8_STEP
    group = inp // scales.shape[1]
    values = codes(fmt, data, inp).reshape(data.shape[0], scales.shape[1], group)
    return (values * scales[..., None]).reshape(data.shape[0], inp)
