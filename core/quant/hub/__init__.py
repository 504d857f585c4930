"""Pre-quantized Hub checkpoints (GPTQ, AWQ, compressed-tensors), converted at load into the
QuantizedWeight block formats the CPU kernels multiply (blocks.py says how, and what is exact).

`check_config` refuses, with one line, a checkpoint whose quantization is not served (before any
weight is read); `HubQuantizedWeights` (reader.py) is the weights reader of such a checkpoint.
bitsandbytes and FP8 checkpoints (bnb.py, fp8.py) are read into core/quant/scaled.py's formats by
their own readers; `weights_reader` picks a checkpoint's reader (core/loader)."""
from __future__ import annotations

from typing import Any, Mapping

from .blocks import SUPPORTED, UnsupportedCheckpoint, refuse
from .compressed import check_compressed
from .gptq import awq_settings, gptq_settings
from .bnb import BnbWeights, check_bnb
from .fp8 import Fp8Weights, check_fp8
from .reader import HubQuantizedWeights

READERS = (HubQuantizedWeights, BnbWeights, Fp8Weights)  # each: reads(quantization_config), (files, config)


def weights_reader(quantization_config: Mapping[str, Any] | None):
    """The reader class of a pre-quantized checkpoint's weights, or None (a float checkpoint)."""
    return next((reader for reader in READERS if reader.reads(quantization_config)), None)


def check_config(method: str, quantization_config: Mapping[str, Any]) -> None:
    """Raises UnsupportedCheckpoint (a QuantizeError) for a quantization_config of `method` (a
    methods.py name) that no reader here serves."""
    if method in ("gptq", "marlin"):
        if method == "marlin" or quantization_config.get("is_marlin_format"):
            raise refuse("a Marlin-format checkpoint (repacked for the Marlin GPU kernel; the CPU reads "
                         "plain GPTQ, checkpoint_format gptq or gptq_v2)")
        gptq_settings(quantization_config)
    elif method == "awq":
        awq_settings(quantization_config)
    elif method == "compressed-tensors":
        check_compressed(quantization_config)
    elif method.startswith("bitsandbytes"):
        check_bnb(quantization_config)
    elif method == "fp8":
        check_fp8(quantization_config)


__all__ = ["READERS", "SUPPORTED", "BnbWeights", "Fp8Weights", "HubQuantizedWeights", "UnsupportedCheckpoint",
           "check_config", "weights_reader"]
