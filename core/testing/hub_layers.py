"""Pre-quantized Hub layers written from their documented layouts (GPTQ, AWQ), by round to
nearest: for tests (tests/core/hub_checkpoints.py, independent of core/quant/hub's readers) and for
benchmark checkpoints of real shapes (benchmarks/gptq_models.py).

- GPTQ: qweight int32 [in * bits / 32, out] packed along `in`, qzeros int32 [groups, out * bits /
  32] packed along `out`, scales fp16 [groups, out], g_idx [in]; checkpoint_format "gptq" stores
  the zero points minus one, subtracted from each packed word as gptqmodel's
  convert_gptq_v2_to_v1_format does.
- AWQ: the GEMM layout AutoAWQ's WQLinear_GEMM.from_linear writes: qweight int32 [in, out / 8],
  value k of word j holding output 8j + [0, 2, 4, 6, 1, 3, 5, 7][k]; qzeros [groups, out / 8] the
  same way; scales fp16 [groups, out].
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed into int32 words along `dim` (value k of a word at bits k*bits..)."""
    per = 32 // bits
    values = values.to(torch.int64).movedim(dim, -1)
    values = values.reshape(*values.shape[:-1], -1, per)
    words = (values << (torch.arange(per) * bits)).sum(-1)
    return _int32(words).movedim(-1, dim).contiguous()


def _int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _seven_bits(scale: torch.Tensor) -> torch.Tensor:
    """scale rounded to 7 significant bits: then scale * zero (zero < 16) has at most 11 and is
    exact in fp16, so the reader's q4_1 m = -scale * zero is exact and the conversion can be
    compared exactly (checkpoints in general round m to fp16: the real tools' tests)."""
    mantissa, exponent = torch.frexp(scale)
    return torch.ldexp(torch.round(mantissa * 128) / 128, exponent)


def _rtn(w: torch.Tensor, bits: int, sym: bool):
    """Round-to-nearest over the last dim: (q unsigned, scale, zero) with w ~ scale * (q - zero)."""
    maxq = (1 << bits) - 1
    if sym:
        scale = w.abs().amax(-1) * 2 / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = _seven_bits((high - low) / maxq)
        zero = torch.round(-low / scale)
    scale = scale.half().float()
    q = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, maxq)
    return q.to(torch.int64), scale, zero.to(torch.int64)


def gptq_pack(w: torch.Tensor, bits: int, group: int, act_order: bool, sym: bool, v1: bool, seed: int = 0):
    """({suffix: tensor} of one GPTQ layer, the float weight they stand for)."""
    out, inp = w.shape
    group = inp if group == -1 else group
    perm = torch.randperm(inp, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int64)
    g_idx[perm] = torch.arange(inp) // group
    groups = inp // group
    q = torch.empty(out, inp, dtype=torch.int64)
    scales, zeros = torch.empty(groups, out), torch.empty(groups, out, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        q[:, cols], scales[g], zeros[g] = _rtn(w[:, cols], bits, sym)
    reference = scales[g_idx].T * (q - zeros[g_idx].T)
    qzeros = _pack(zeros, bits, dim=1)
    if v1:  # gptqmodel's v2 -> v1: each packed word minus 0x11111111 (4 bits) / 0x01010101 (8 bits)
        qzeros = _int32(qzeros.to(torch.int64) - sum(1 << s for s in range(0, 32, bits)))
    tensors = {"qweight": _pack(q.T, bits, dim=0), "qzeros": qzeros, "scales": scales.half(),
               "g_idx": g_idx.to(torch.int32)}
    return tensors, reference


def gptq_config(bits: int, group: int, act_order: bool, sym: bool, v1: bool) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
            "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": False, "pack_dtype": "int32"}


def awq_pack(w: torch.Tensor, group: int, seed: int = 0):
    out, inp = w.shape
    q, scales, zeros = _rtn(w.reshape(out, inp // group, group), 4, sym=False)  # [out, groups, group]
    reference = (scales[..., None] * (q - zeros[..., None])).reshape(out, inp)
    interleave = torch.tensor([8 * j + k for j in range(out // 8) for k in AWQ_ORDER])  # word j's value k
    tensors = {"qweight": _pack(q.reshape(out, inp).T[:, interleave], 4, dim=1),
               "qzeros": _pack(zeros.T[:, interleave], 4, dim=1), "scales": scales.T.half().contiguous()}
    return tensors, reference


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}
