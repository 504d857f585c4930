"""float8 e4m3 checkpoints, read into core/quant/scaled.py's "fp8_e4m3" (weight-only: any input
scales are dropped, activations stay in --dtype):

- compressed-tensors (llm-compressor's FP8, FP8_DYNAMIC, FP8_BLOCK schemes; format
  "float-quantized"): per linear `weight` float8_e4m3fn [out, in] and `weight_scale` (float32 /
  bf16 / fp16): [1] per tensor, [out, 1] per channel, [out, in / group] per group, or
  [out / bn, in / bk] per block (block_structure); static schemes add `input_scale`.
- quant_method "fp8" (transformers' FineGrainedFP8: DeepSeek-V3, Qwen3 FP8): `weight` float8_e4m3fn
  and `weight_scale_inv` [ceil(out / bn), ceil(in / bk)] float32 with weight_block_size [bn, bk]
  (128x128), or a per-tensor `weight_scale` without it. Despite its name, w = fp8 * weight_scale_inv.
w = fp8 * scale of the weight's (tensor / channel / group / block). Block scales are repeated
along the rows (each row carries its block row's scales); a weight whose last block is partial
along `in` (in % bk) is dequantized to floats (logged). Linears the checkpoint kept in floats
(ignore, modules_to_not_convert) come as they are. Refused with one line: e5m2 weights, a
quantized KV cache, sparsity or transforms, another compressed-tensors format, a scale whose shape
fits none of the above.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from ..weight import QuantizedWeight
from .blocks import UnsupportedCheckpoint
from .layered import Converted, LayeredWeights

PARTS = ("weight", "weight_scale", "weight_scale_inv", "input_scale")
DEFAULT_BLOCK = (128, 128)
STRATEGIES = ("tensor", "channel", "group", "block")


def refuse(what: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(f"FP8 checkpoint: {what} is not supported; the CPU serves float8 e4m3 weights "
                                 "scaled per tensor, channel, group or block (weight-only)")


def check_fp8(config: Mapping[str, Any]) -> None:
    """Refuses an FP8 quantization_config (quant_method fp8, or compressed-tensors float8) no reader serves."""
    if str(config.get("fmt", "e4m3")).lower() != "e4m3":
        raise refuse(f"fmt {config.get('fmt')!r}")
    if config.get("kv_cache_scheme"):
        raise refuse("a quantized KV cache (kv_cache_scheme)")
    if (config.get("sparsity_config") or {}).get("format", "dense") not in ("dense", None):
        raise refuse("sparsity")
    if config.get("transform_config"):
        raise refuse("transforms (transform_config)")
    for name, scheme in (config.get("config_groups") or {}).items():
        fmt = scheme.get("format") or config.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise refuse(f"compressed-tensors scheme {name!r} in format {fmt!r}")
        strategy = (scheme.get("weights") or {}).get("strategy", "tensor")
        if strategy not in STRATEGIES:
            raise refuse(f"compressed-tensors scheme {name!r}: weight strategy {strategy!r}")


def block_size(config: Mapping[str, Any]) -> tuple[int, int]:
    if config.get("weight_block_size"):
        return tuple(int(n) for n in config["weight_block_size"])
    for scheme in (config.get("config_groups") or {}).values():
        structure = (scheme.get("weights") or {}).get("block_structure")
        if structure:
            return tuple(int(n) for n in structure)
    return DEFAULT_BLOCK


class Fp8Layout:
    what = "fp8"

    def __init__(self, config: Mapping[str, Any]):
        self.block = block_size(config)

    def layers(self, names: set[str], dtypes: Callable[[str], Any]) -> set[str]:
        prefixes = set()
        for name in names:
            if name.endswith(".weight") and str(dtypes(name)).upper().startswith("F8"):
                if str(dtypes(name)).upper() != "F8_E4M3":
                    raise refuse(f"{name}: {dtypes(name)} weights (only e4m3)")
                prefixes.add(name[:-len("weight")])
        return prefixes

    def part(self, name: str, prefix: str) -> str | None:
        part = name[len(prefix):]
        return part if part in PARTS else None

    def convert(self, prefix: str, parts: Mapping[str, torch.Tensor]) -> list[tuple[str, Converted]]:
        weight = parts["weight"]
        scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
        if scale is None:
            raise refuse(f"layer {prefix}weight without weight_scale or weight_scale_inv")
        return [(prefix + "weight", fp8_weight(weight, scale.float(), self.block, f"layer {prefix}weight"))]


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], what: str) -> Converted:
    """The float8 weight [out, in] and its scale as "fp8_e4m3" (floats where blocks straddle `in`)."""
    out, inp = weight.shape
    data = weight.contiguous().view(torch.uint8)
    if scale.numel() == 1:  # per tensor
        return QuantizedWeight("fp8_e4m3", (out, inp), data, scale.reshape(1, 1).expand(out, 1).contiguous())
    if scale.dim() == 1 and scale.shape[0] == out:
        scale = scale.reshape(out, 1)
    if scale.dim() == 2 and scale.shape[0] == out and inp % scale.shape[1] == 0:  # per channel or group
        return QuantizedWeight("fp8_e4m3", (out, inp), data, scale.contiguous())
    bn, bk = block
    if scale.dim() != 2 or tuple(scale.shape) != (math.ceil(out / bn), math.ceil(inp / bk)):
        raise refuse(f"{what}: scale {tuple(scale.shape)} for a weight {(out, inp)} (blocks {bn}x{bk})")
    rows = scale.repeat_interleave(bn, dim=0)[:out]  # [out, ceil(in / bk)]
    if inp % bk == 0:
        return QuantizedWeight("fp8_e4m3", (out, inp), data, rows.contiguous())
    return weight.float() * rows.repeat_interleave(bk, dim=1)[:, :inp]


class Fp8Weights(LayeredWeights):
    """The weights reader of an FP8 checkpoint (core/loader picks it through hub.weights_reader)."""

    @staticmethod
    def reads(quantization_config: Mapping[str, Any] | None) -> bool:
        from ..methods import detect

        method = detect(dict(quantization_config)) if quantization_config else None
        return method is not None and method.name == "fp8"

    def __init__(self, files: list[str], quantization_config: Mapping[str, Any]):
        check_fp8(quantization_config)
        super().__init__(files, Fp8Layout(quantization_config))
