"""GPTQ and AWQ checkpoints (quantization_config quant_method "gptq" / "awq"), one layer at a time.

GPTQ (AutoGPTQ, gptqmodel, optimum): per layer `qweight` int32 [in * bits / 32, out] (packed along
`in`, value k of a word in bits k*bits..), `qzeros` int32 [groups, out * bits / 32] (packed along
`out`), `scales` fp16 [groups, out], `g_idx` int32 [in] (a column's group; absent: column // group).
w[o, i] = scales[g, o] * (q[i, o] - zero[g, o]), g = g_idx[i]. checkpoint_format "gptq" (v1, what
gptqmodel writes by default) stores each zero point minus one, subtracted from the whole packed
word (gptqmodel's convert_gptq_v2_to_v1_format: qzeros -= 0x11111111 for 4 bits): it is read back
by adding the same word (mod 2^32) before unpacking, as gptqmodel does; "gptq_v2" stores the zero
points as they are. "marlin" / "bitblas" (repacked for GPU kernels) are refused.

AWQ (AutoAWQ's GEMM layout, version "gemm"): `qweight` int32 [in, out / 8] packed along `out` in
the interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (value k of a word is output 8j + order[k]),
`qzeros` int32 [groups, out / 8] the same way (zero points as they are), `scales` fp16 [groups,
out]; groups of group_size contiguous input columns. Other AWQ versions are refused.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .blocks import check_bits_and_group, group_order, refuse, to_quantized, unpack_int32

GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value k of a packed word holds output 8j + AWQ_ORDER[k]


def gptq_settings(config: Mapping[str, Any]) -> tuple[int, int, bool]:
    """(bits, group size, v1 zero points) of a GPTQ quantization_config; refuses what is not served."""
    fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    if fmt not in GPTQ_FORMATS:
        raise refuse(f"GPTQ checkpoint_format {fmt!r} (repacked for a GPU kernel; the CPU reads "
                     f"checkpoint_format {' or '.join(GPTQ_FORMATS)})")
    if config.get("dynamic"):
        raise refuse("GPTQ with per-module overrides (dynamic)")
    if str(config.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
        raise refuse(f"GPTQ pack_dtype {config.get('pack_dtype')}")
    bits, group = int(config.get("bits", 4)), int(config.get("group_size", 128))
    check_bits_and_group(bits, group, bool(config.get("sym", True)) or bits == 4, "GPTQ")
    return bits, group, fmt == "gptq"


def awq_settings(config: Mapping[str, Any]) -> tuple[int, int]:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(f"AWQ version {version!r} (the CPU reads AutoAWQ's GEMM layout, version \"gemm\")")
    if config.get("zero_point") is False:
        raise refuse("AWQ without zero points")
    bits, group = int(config.get("bits", config.get("w_bit", 4))), int(config.get("group_size",
                                                                                config.get("q_group_size", 128)))
    if bits != 4:
        raise refuse(f"AWQ, {bits}-bit weights")
    check_bits_and_group(bits, group, False, "AWQ")
    return bits, group


def gptq_layer(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], what: str):
    bits, group, v1 = gptq_settings(config)
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    u = unpack_int32(qweight, bits, dim=0).T  # [out, in]
    out, inp = u.shape
    if v1:  # the zero points were stored minus one, word-wise
        step = sum(1 << shift for shift in range(0, 32, bits))
        qzeros = ((qzeros.to(torch.int64) & 0xFFFFFFFF) + step) & 0xFFFFFFFF
    zero = unpack_int32(qzeros, bits, dim=1)[:, :out].T  # [out, groups]
    group = inp if group == -1 else group
    order = group_order(tensors.get("g_idx"), inp, group, what)
    return to_quantized(u, scales.float().T, zero, bits, what, order)


def awq_layer(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], what: str):
    bits, _ = awq_settings(config)
    reverse = torch.tensor(AWQ_ORDER).argsort()  # output 8j + r is value reverse[r] of word j

    def outputs(packed: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> [rows, out] in output order
        values = unpack_int32(packed, bits, dim=1)
        return values.reshape(values.shape[0], -1, 8)[..., reverse].reshape(values.shape[0], -1)

    u, zero = outputs(tensors["qweight"]).T, outputs(tensors["qzeros"]).T  # [out, in], [out, groups]
    return to_quantized(u, tensors["scales"].float().T, zero, bits, what)
