"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama decoder with three differences, all
handled by the shared pieces rather than copied here:

- the checkpoint already fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`, gate
  first): `load_weights` copies them into our fused projections of the same names
  (MergedLinear.load: each part's rows; this shard's slice of each under tensor parallelism);
- a partial rotary factor (Phi-4-mini: 0.75) rotates only the first dims of each head
  (core/layers/rotary.py: rotary_dim, apply_partial_rotary);
- "longrope" ("su") scaling: short factors while a request fits the original context,
  long ones past it, and an attention factor on cos/sin (rotary.py: rope_frequencies),
- and `sliding_window`, when configured, on every layer (llama.layer_sliding_window).
"""
from __future__ import annotations

from typing import Any

import torch

from ..layers.parallel import NO_TP, TensorParallel
from .llama import KernelFactory, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, make_kernel: KernelFactory, block_size: int, dtype: torch.dtype,
                 tp: TensorParallel = NO_TP):
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise NotImplementedError("Phi-3 checkpoints with attention or MLP biases are not supported")
        super().__init__(config, make_kernel, block_size, dtype, tp)
