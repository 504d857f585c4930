"""What `--quantize` does to a model at load, in core (no kernels here): which source it
needs, and for int8 / int4 which linears are quantized how.

- "gguf": the GGUF file's own blocks are loaded packed (core/quant/gguf.py); it needs a GGUF model.
- "int8": every linear, symmetric per-output-channel int8.
- "int4": every linear asymmetric int4 in groups of 32, except the output head (the largest
  matmul, and the one whose error reaches the logits directly), which is int8, as llama.cpp's
  Q4 presets keep it at Q6_K/Q8_0. A linear whose input width 32 does not divide is int8 too.
Each reason for a choice other than the asked one is logged once.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..layers.linear import Linear
from .methods import QuantizeError, lookup
from .weight import BLOCK, quantize_int4, quantize_int8

logger = logging.getLogger(__name__)

QUANTIZE_AT_LOAD = ("int8", "int4")


def check_quantize_source(quantize: str | None, gguf_file: str | None) -> None:
    """Refuses a quantization that cannot apply to this model's source (the method table, methods.py)."""
    if quantize is None:
        return
    method = lookup(quantize)
    if method.source == "gguf" and gguf_file is None:
        raise QuantizeError("--quantize gguf needs a GGUF model file; this model has no GGUF weights "
                            "(use --quantize int8 or int4 to quantize a float checkpoint)")


@torch.inference_mode()
def quantize_model(model: nn.Module, method: str, head: nn.Module | None = None) -> int:
    """Quantizes every float Linear of `model` for `method` ("int8" | "int4"); `head`: the
    output head (int8 under int4). Returns how many were quantized."""
    if method not in QUANTIZE_AT_LOAD:
        raise QuantizeError(f"--quantize {method} is not made at load; one of {QUANTIZE_AT_LOAD}")
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
