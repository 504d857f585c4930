"""compressed-tensors checkpoints (quant_method "compressed-tensors": llm-compressor's W4A16,
W4A16_ASYM and W8A16 schemes), one layer at a time.

Weight-only integer schemes only (no input_activations), in format "pack-quantized" (per layer
`weight_packed` int32 [out, in * bits / 32], value k of a word in bits k*bits.. holding the
signed value plus 2^(bits-1); `weight_scale` [out, groups] in the model's dtype; `weight_shape`;
asymmetric: `weight_zero_point` int32 [out * bits / 32, groups], packed the same way along `out`;
act-order: `weight_g_idx`), or "naive-quantized" (an int8 `weight`). w = scale * (q - zero_point)
with q and zero_point signed. Strategies "group" (group_size a multiple of 32), "channel" and
"tensor". Refused with one line: float weights (NVFP4, MXFP4; FP8 is fp8.py's), quantized
activations (W8A8, W4A8), a quantized KV cache, sparsity, transforms, other formats.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .blocks import check_bits_and_group, group_order, refuse, to_quantized, unpack_int32

FORMATS = ("pack-quantized", "naive-quantized")
STRATEGIES = ("group", "channel", "tensor")


def check_compressed(config: Mapping[str, Any]) -> None:
    """Refuses a compressed-tensors quantization_config this reader does not serve."""
    fmt = config.get("format")
    groups = config.get("config_groups") or {}
    if not groups:
        raise refuse("compressed-tensors without config_groups")
    for name, scheme in groups.items():
        what = f"compressed-tensors scheme {name!r}"
        # activations first: llm-compressor writes its W8A8 / W4A8 schemes in format "int-quantized",
        # which the format check would name instead of what makes them unservable
        if scheme.get("input_activations") or scheme.get("output_activations"):
            raise refuse(f"{what}, quantized activations (W8A8, W4A8; the CPU serves weight-only W4A16, W8A16)")
        scheme_format = scheme.get("format") or fmt
        if scheme_format not in FORMATS:
            raise refuse(f"{what}, format {scheme_format!r} (the CPU reads {', '.join(FORMATS)})")
        weights = scheme.get("weights") or {}
        if weights.get("type", "int") != "int":
            raise refuse(f"{what}, {weights.get('type')} weights (NVFP4, MXFP4; FP8 is the fp8 method's)")
        strategy = weights.get("strategy", "tensor")
        if strategy not in STRATEGIES:
            raise refuse(f"{what}, strategy {strategy!r}")
        group = int(weights.get("group_size") or -1) if strategy == "group" else -1
        check_bits_and_group(int(weights.get("num_bits", 8)), group, bool(weights.get("symmetric", True)), what)
    if config.get("kv_cache_scheme"):
        raise refuse("compressed-tensors with a quantized KV cache (kv_cache_scheme)")
    if (config.get("sparsity_config") or {}).get("format", "dense") not in ("dense", None):
        raise refuse("compressed-tensors with sparsity")
    if config.get("transform_config"):
        raise refuse("compressed-tensors with transforms (transform_config)")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"compressed-tensors quantization_status {status!r} (the CPU reads \"compressed\")")


def compressed_layer(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], what: str):
    scale = tensors["weight_scale"].float()
    if "weight_packed" in tensors:
        packed = tensors["weight_packed"]
        out, inp = (int(n) for n in tensors["weight_shape"].tolist())
        bits = packed.shape[1] * 32 // inp
        u = unpack_int32(packed, bits, dim=1)[:, :inp]
    else:  # naive-quantized: the signed values as int8
        out, inp = tensors["weight"].shape
        bits = 8
        u = tensors["weight"].to(torch.int64) + 128
    middle = 1 << (bits - 1)
    scale = scale.reshape(out, -1) if scale.numel() != 1 else scale.reshape(1, 1).expand(out, 1)
    zero = torch.full(scale.shape, middle, dtype=torch.int64)
    if "weight_zero_point" in tensors:
        point = tensors["weight_zero_point"]
        if point.dtype == torch.int32:  # packed along out, unsigned (signed + middle)
            zero = unpack_int32(point, bits, dim=0)[:out].reshape(out, -1)
        else:  # signed, as they are
            zero = (point.to(torch.int64).reshape(-1, 1) + middle).expand(scale.shape) if point.numel() == 1 \
                else point.to(torch.int64).reshape(out, -1) + middle
    group = inp // scale.shape[1]
    order = group_order(tensors.get("weight_g_idx"), inp, group, what)
    return to_quantized(u, scale, zero, bits, what, order)
