"""bitsandbytes checkpoints (quantization_config quant_method "bitsandbytes"), as transformers'
save_pretrained writes a model loaded with BitsAndBytesConfig, read into core/quant/scaled.py's
formats with plain torch (bitsandbytes itself is not needed to read them; the tests check the
result against bitsandbytes' own dequantize_4bit / int8_vectorwise_dequant).

4-bit (load_in_4bit; bnb_4bit_quant_type nf4 or fp4), per linear `<layer>.`:
- `weight`: uint8 [out * in / 2, 1] (or another bnb_4bit_quant_storage dtype, read as its bytes):
  the row-major weight, two codes a byte, the first in the high half;
- `weight.absmax`: one absmax per `blocksize` weights of the flattened weight: float32, or uint8
  when double-quantized (bnb_4bit_use_double_quant), then `weight.nested_absmax` float32 (one per
  `nested_blocksize` absmax), `weight.nested_quant_map` (the 256-value code) and the offset:
  absmax = nested_quant_map[absmax] * nested_absmax[i // nested_blocksize] + nested_offset;
- `weight.quant_map`: the 16-value code (checked against bitsandbytes' NF4 / FP4 table);
- `weight.quant_state.bitsandbytes__<nf4|fp4>`: a JSON blob (uint8): quant_type, blocksize, dtype,
  shape and the nested_* values.
-> "bnb_nf4" / "bnb_fp4" with absmax [out, in / blocksize]; a weight whose blocks straddle rows
  (in % blocksize) is dequantized to floats (logged).

8-bit (load_in_8bit, LLM.int8): `weight` int8 [out, in], `SCB` float32 [out] (each row's absmax),
`weight_format` (0: row-major, the only layout bitsandbytes still writes) -> "bnb_int8".
Linears the checkpoint kept in floats (llm_int8_skip_modules; transformers keeps lm_head) come as
they are. Refused with one line: a 4-bit code other than nf4 / fp4, llm_int8_has_fp16_weight
checkpoints, another weight_format.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Mapping

import torch

from ..scaled import CODES
from ..weight import QuantizedWeight
from .blocks import UnsupportedCheckpoint
from .layered import Converted, LayeredWeights

QUANT_STATE = "weight.quant_state.bitsandbytes__"
PARTS_4BIT = ("weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map")
PARTS_8BIT = ("weight", "SCB", "weight_format")
FORMATS = {"nf4": "bnb_nf4", "fp4": "bnb_fp4"}


def refuse(what: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"bitsandbytes checkpoint: {what} is not supported; the CPU serves 4-bit nf4 / fp4 "
                                 "(double-quantized or not) and LLM.int8 (load_in_8bit) checkpoints")


def check_bnb(config: Mapping[str, Any]) -> None:
    """Refuses a bitsandbytes quantization_config no reader here serves."""
    if config.get("load_in_4bit"):
        kind = str(config.get("bnb_4bit_quant_type") or "fp4").lower()
        if kind not in FORMATS:
            raise refuse(f"bnb_4bit_quant_type {kind!r}")
    elif config.get("llm_int8_has_fp16_weight"):
        raise refuse("llm_int8_has_fp16_weight (an 8-bit checkpoint whose weights are kept in fp16)")


class BnbLayout:
    what = "bitsandbytes"

    def layers(self, names: set[str], dtypes: Callable[[str], Any]) -> set[str]:
        prefixes = {name.split(QUANT_STATE)[0] for name in names if QUANT_STATE in name}
        return prefixes | {name[:-len("SCB")] for name in names if name.endswith(".SCB")}

    def part(self, name: str, prefix: str) -> str | None:
        part = name[len(prefix):]
        return part if part in PARTS_4BIT or part in PARTS_8BIT or part.startswith(QUANT_STATE) else None

    def convert(self, prefix: str, parts: Mapping[str, torch.Tensor]) -> list[tuple[str, Converted]]:
        what = f"layer {prefix}weight"
        if "SCB" in parts:
            return [(prefix + "weight", int8_weight(parts, what))]
        return [(prefix + "weight", four_bit_weight(parts, what))]


def int8_weight(parts: Mapping[str, torch.Tensor], what: str) -> QuantizedWeight:
    weight, scb = parts["weight"], parts["SCB"]
    if "weight_format" in parts and int(parts["weight_format"].reshape(-1)[0]) != 0:
        raise refuse(f"{what}: weight_format {int(parts['weight_format'].reshape(-1)[0])} (only 0, row-major)")
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise refuse(f"{what}: an 8-bit weight of {weight.dtype} {tuple(weight.shape)}")
    out = weight.shape[0]
    scales = scb.float().reshape(out, 1).contiguous()
    return QuantizedWeight("bnb_int8", tuple(weight.shape), weight.contiguous(), scales)


def quant_state(parts: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    blob = next(tensor for name, tensor in parts.items() if name.startswith(QUANT_STATE))
    return json.loads(bytes(blob.to(torch.uint8).numpy()).decode("utf-8"))


def four_bit_weight(parts: Mapping[str, torch.Tensor], what: str) -> Converted:
    state = quant_state(parts)
    kind = str(state["quant_type"]).lower()
    if kind not in FORMATS:
        raise refuse(f"{what}: quant_type {kind!r}")
    fmt = FORMATS[kind]
    if not torch.equal(parts["weight.quant_map"].float(), CODES[fmt]):
        raise refuse(f"{what}: a {kind} quant_map other than bitsandbytes' own")
    out, inp = (int(n) for n in state["shape"])
    blocksize = int(state["blocksize"])
    absmax = parts["weight.absmax"]
    if "weight.nested_absmax" in parts:  # double-quantized: uint8 absmax over the nested code
        nested = parts["weight.nested_absmax"].float()
        index = torch.arange(absmax.numel()) // int(state["nested_blocksize"])
        absmax = parts["weight.nested_quant_map"].float()[absmax.long()] * nested[index] + \
            torch.tensor(float(state["nested_offset"]), dtype=torch.float32)
    absmax = absmax.float().reshape(-1)
    data = parts["weight"].contiguous().view(torch.uint8).reshape(-1)
    if inp % blocksize == 0 and inp % 2 == 0:
        return QuantizedWeight(fmt, (out, inp), data[:out * inp // 2].reshape(out, inp // 2).contiguous(),
                               absmax.reshape(out, inp // blocksize).contiguous())
    # blocks straddle rows: the flat weight dequantized (code * absmax per block), as floats
    codes = torch.stack([data >> 4, data & 0x0F], dim=-1).reshape(-1)[:out * inp]
    values = CODES[fmt][codes.long()] * absmax.repeat_interleave(blocksize)[:out * inp]
    return values.reshape(out, inp).to(getattr(torch, str(state.get("dtype", "float32"))))


class BnbWeights(LayeredWeights):
    """The weights reader of a bitsandbytes checkpoint (core/loader picks it through hub.weights_reader)."""

    @staticmethod
    def reads(quantization_config: Mapping[str, Any] | None) -> bool:
        return bool(quantization_config) and str(quantization_config.get("quant_method", "")).lower() == "bitsandbytes"

    def __init__(self, files: list[str], quantization_config: Mapping[str, Any]):
        check_bnb(quantization_config)
        super().__init__(files, BnbLayout())
