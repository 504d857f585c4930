"""Quantized weights, backend-neutral: the representation loaders yield and core layers hold
(weight.py), how a float model is quantized at load and a GGUF file's blocks are read without
dequantizing (apply.py, gguf.py). Kernels that multiply them live in the backends."""
from .weight import BLOCK, BLOCK_BYTES, FORMATS, QuantizedWeight, dequantize, quantize_int4, quantize_int8

__all__ = ["BLOCK", "BLOCK_BYTES", "FORMATS", "QuantizedWeight", "dequantize", "quantize_int4", "quantize_int8"]
