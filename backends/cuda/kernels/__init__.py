"""Triton kernels of the CUDA backend (ROCm's Triton builds them too): KV write,
paged attention, fused RMSNorm / rotary / SiLU-and-mul, the fused mixture-of-experts GEMM,
the dequantize-GEMM of quantized weights, the LoRA shrink and expand.

Importing this package imports triton; the CUDA backend imports it only when it
builds a kernel, so plugin discovery works on machines without triton. On a CPU
the kernels run under Triton's interpreter: triton reads TRITON_INTERPRET when a
kernel is defined, i.e. when this package is first imported.
"""
from .dequant_gemm import TilePlan, dequant_gemm, dequant_gemm_reference, plan_tiles
from .fused import apply_rotary, rms_norm, silu_and_mul
from .kv_write import write_kv
from .lora import TritonLoraKernel, lora_expand, lora_shrink
from .moe import fused_experts, moe_align_block_size
from .paged_attention import MAX_KV_SPLITS, TileShape, choose_num_kv_splits, paged_attention, tile_shape

__all__ = ["MAX_KV_SPLITS", "TilePlan", "TileShape", "TritonLoraKernel", "apply_rotary", "choose_num_kv_splits", "dequant_gemm",
           "dequant_gemm_reference", "fused_experts", "lora_expand", "lora_shrink", "moe_align_block_size", "paged_attention", "plan_tiles",
           "rms_norm", "silu_and_mul", "tile_shape", "write_kv"]
