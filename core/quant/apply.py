"""What `--quantize` int8 / int4 do to a float model at load, in core (no kernels here): which
linears are quantized how (which method a model is served in is decided in methods.py).

- "int8": every linear, symmetric per-output-channel int8.
- "int4": every linear asymmetric int4 in groups of 32, except the output head (the largest
  matmul, and the one whose error reaches the logits directly), which is int8, as llama.cpp's
  Q4 presets keep it at Q6_K/Q8_0. A linear whose input width 32 does not divide is int8 too.
- "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8": every linear (the head too, as
  TGI does) by its SCALED_AT_LOAD function (weight.py: bitsandbytes' own quantizers, or per-channel
  float8); a linear its format cannot hold (4-bit: in % 64) stays in --dtype.
Each reason for a choice other than the asked one is logged once.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..layers.linear import Linear
from .methods import QuantizeError
from .scaled import BNB_BLOCKSIZE
from .weight import BLOCK, quantize_bnb, quantize_fp8, quantize_int4, quantize_int8

logger = logging.getLogger(__name__)

# method -> its quantizer of one float [out, in] weight (None: the weight stays float)
SCALED_AT_LOAD = {"bitsandbytes": lambda w: quantize_bnb(w, "bnb_int8"),
                  "bitsandbytes-nf4": lambda w: quantize_bnb(w, "bnb_nf4"),
                  "bitsandbytes-fp4": lambda w: quantize_bnb(w, "bnb_fp4"), "fp8": quantize_fp8}
QUANTIZE_AT_LOAD = ("int8", "int4", *SCALED_AT_LOAD)


@torch.inference_mode()
def quantize_model(model: nn.Module, method: str, head: nn.Module | None = None) -> int:
    """Quantizes every float Linear of `model` for `method` (one of QUANTIZE_AT_LOAD); `head`: the
    output head (int8 under int4). Returns how many were quantized."""
    if method not in QUANTIZE_AT_LOAD:
        raise QuantizeError(f"--quantize {method} is not made at load; one of {QUANTIZE_AT_LOAD}")
    if method.startswith("bitsandbytes"):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise QuantizeError(f"--quantize {method} needs the bitsandbytes package (pip install bitsandbytes)") from None
    references: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            references[id(param)] = references.get(id(param), 0) + 1
    count = 0
    reasons: set[str] = set()
    for module in model.modules():
        if not isinstance(module, Linear) or module.quantized is not None:
            continue
        weight = module.weight.detach()
        if method in SCALED_AT_LOAD:
            quantized = SCALED_AT_LOAD[method](weight)
            if quantized is None:
                reasons.add(f"linears whose input width {BNB_BLOCKSIZE} does not divide stay in --dtype")
                continue
            module.hold_quantized(quantized, free_float=references[id(module.weight)] == 1)
            count += 1
            continue
        kind = method
        if method == "int4" and module is head:
            kind, reason = "int8", "the output head is int8 (int4 elsewhere)"
            reasons.add(reason)
        elif method == "int4" and weight.shape[1] % BLOCK:
            kind, reason = "int8", f"linears whose input width {BLOCK} does not divide are int8"
            reasons.add(reason)
        quantized = quantize_int8(weight) if kind == "int8" else quantize_int4(weight)
        module.hold_quantized(quantized, free_float=references[id(module.weight)] == 1)
        count += 1
    for reason in sorted(reasons):
        logger.info("--quantize %s: %s", method, reason)
    logger.info("--quantize %s: %d linears quantized", method, count)
    return count
