"""Quantized weights, backend-neutral: the representation loaders yield and core layers hold
(weight.py; parts.py for a fused weight whose parts differ in format), the one table of methods
(methods.py) and how a float model is quantized at load (apply.py); a GGUF file's blocks are read
without dequantizing in core/loader/gguf_packed.py. Kernels that multiply them live in the backends."""

from .weight import (BLOCK, BLOCK_BYTES, BLOCK_WEIGHTS, FORMATS, GROUP_BITS, AffineBlocks, QuantizedWeight, affine_blocks,
                     dequantize, dequantize_rows, quantize_int4, quantize_int8, scale_min_k4)

__all__ = ["BLOCK", "BLOCK_BYTES", "BLOCK_WEIGHTS", "FORMATS", "GROUP_BITS", "AffineBlocks", "QuantizedWeight",
           "affine_blocks", "dequantize", "dequantize_rows", "quantize_int4", "quantize_int8", "scale_min_k4"]
