"""The one decision of which quantization method a model's weights are served in.

It sits above the method table (methods.py) and the checkpoint readers (hub/): a checkpoint's
method comes from the table, and the variant is checked by its reader before any weight is read.
"""
from __future__ import annotations

from typing import Any, Mapping

from .hub import check_config
from .methods import NONE, QuantizeError, detect, lookup


def served_method(requested: str | None, gguf_file: str | None, quantization_config: Mapping[str, Any] | None,
                  sharded: bool = False, backend_methods: tuple[str, ...] = ()) -> tuple[str | None, str]:
    """The one decision of which method the weights are served in, and why (for the start log):
    - a GGUF file: its own blocks ("gguf"), as llama.cpp and ollama serve it, unless --quantize
      asks another (int8 / int4 requantize the dequantized weights; "none": floats in --dtype).
      Tensor-parallel shards, and a backend that does not serve "gguf" (`backend_methods`: its
      Capabilities.quantizations), take floats: quantized weights are not split.
    - a pre-quantized checkpoint: the method its quantization_config names; a --quantize naming
      another is refused.
    - a float checkpoint: what --quantize asks (None: the checkpoint's dtype).
    Floats from a GGUF come back as "none", not None, so that deciding again gives the same answer."""
    method = lookup(requested) if requested is not None and requested != NONE else None
    checkpoint = detect(quantization_config) if gguf_file is None else None
    if method is not None and method.source == "gguf" and gguf_file is None:
        raise QuantizeError(f"--quantize {requested} needs a GGUF model file; this model has no GGUF weights "
                            "(use --quantize int8 or int4 to quantize a float checkpoint)")
    if method is not None and method.source == "checkpoint" and checkpoint is None:
        raise QuantizeError(f"--quantize {requested} needs a checkpoint quantized with {requested} (its config.json's "
                            "quantization_config); use --quantize int8 or int4 to quantize a float checkpoint")
    if checkpoint is not None:
        check_config(checkpoint.name, quantization_config)
        if requested not in (None, checkpoint.name) and (method is None or checkpoint.name not in method.alias_of):
            raise QuantizeError(f"--quantize {requested}: the checkpoint is quantized with {checkpoint.name} "
                                f"(its quantization_config); serve it without --quantize or with --quantize "
                                f"{checkpoint.name}")
        return checkpoint.name, f"the checkpoint's quantization_config ({checkpoint.summary})"
    if gguf_file is not None and requested is None:
        if sharded:
            return NONE, "the GGUF file dequantized: tensor-parallel shards do not split quantized weights"
        if "gguf" not in backend_methods:
            return NONE, "the GGUF file dequantized: the backend does not multiply GGUF blocks"
        return "gguf", "the GGUF file's own blocks (--quantize none dequantizes, int8/int4 requantize)"
    if requested == NONE:
        return NONE, "dequantized into --dtype (--quantize none)"
    if method is not None and method.alias_of:
        return method.alias_of[0], f"--quantize {requested}: {method.summary}"
    return requested, "--quantize" if requested is not None else "the checkpoint's float weights"
