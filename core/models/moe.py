"""Mixture-of-experts decoders on the Llama skeleton: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention is the Llama family's (Qwen2-MoE's q/k/v bias and Qwen3-MoE's per-head q/k
norms included); the feed-forward of a sparse layer is a router (a Linear to the expert
logits) and FusedMoE (core/layers/fused_moe.py), whose experts run batched per step.
- Mixtral: every layer sparse; top-2 of a softmax, renormalised; experts w1 (gate),
  w3 (up), w2 (down) under `block_sparse_moe`.
- Qwen2-MoE: a shared expert (a gated MLP) added through a sigmoid gate; top-k
  renormalised only with norm_topk_prob; layers listed in mlp_only_layers, or off the
  decoder_sparse_step rhythm, are dense.
- Qwen3-MoE: as Qwen2-MoE without the shared expert.
Checkpoints come with one tensor per expert (`...experts.{e}.gate_proj.weight`) or, as
transformers 5 keeps them in memory, stacked (`...experts.gate_up_proj`, `...experts.down_proj`).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from ..layers import Linear, MergedLinear, SiluAndMul
from ..layers.fused_moe import FusedMoE
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

EXPERT_WEIGHT = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
EXPERT_PARTS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
STACKED_EXPERT_NAMES = {".mlp.experts.gate_up_proj": ".mlp.experts.w13_weight",
                        ".mlp.experts.down_proj": ".mlp.experts.w2_weight"}


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) of a given width (Qwen2-MoE's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size), dtype=dtype)
        self.act = SiluAndMul()
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert)."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        is_mixtral = config.model_type == "mixtral"
        num_experts = config.num_local_experts if is_mixtral else config.num_experts
        expert_size = config.intermediate_size if is_mixtral else config.moe_intermediate_size
        renormalize = is_mixtral or bool(config.norm_topk_prob)
        self.gate = Linear(config.hidden_size, num_experts, dtype=dtype)
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size, expert_size,
                                renormalize, dtype=dtype)
        self.shared_expert = self.shared_expert_gate = None
        shared_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if shared_size:
            self.shared_expert = GatedMLP(config.hidden_size, shared_size, dtype)
            self.shared_expert_gate = Linear(config.hidden_size, 1, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    if config.model_type == "mixtral":
        return True
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return SparseMoeBlock(config, dtype) if is_sparse_layer(config, layer_idx) else LlamaMLP(config, dtype)


class MoeModel(LlamaModel):
    layer_class = MoeDecoderLayer


class MoeForCausalLM(LlamaForCausalLM):
    model_class = MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert tensors go into the stacked expert weights; the rest load as in Llama."""
        expert_parts: dict[str, set[tuple[int, str]]] = {}
        loaded = super().load_weights(self._route_experts(weights, expert_parts))
        for prefix, parts in expert_parts.items():
            experts = self.get_submodule(prefix)
            if len(parts) == 3 * experts.num_experts:
                loaded |= {f"{prefix}.w13_weight", f"{prefix}.w2_weight"}
        return loaded

    def _route_experts(self, weights: Iterable[tuple[str, torch.Tensor]],
                       expert_parts: dict[str, set[tuple[int, str]]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            match = EXPERT_WEIGHT.match(name)
            if match is None:
                for stacked, ours in STACKED_EXPERT_NAMES.items():
                    if name.endswith(stacked):
                        name = name[:-len(stacked)] + ours
                yield name, tensor
                continue
            prefix, expert, part = f"{match[1]}.mlp.experts", int(match[2]), EXPERT_PARTS[match[3]]
            module = self.get_submodule(prefix)
            if not isinstance(module, FusedMoE) or expert >= module.num_experts:
                raise ValueError(f"checkpoint weight {name!r} has no matching expert in the model")
            module.load_expert(expert, part, tensor)
            expert_parts.setdefault(prefix, set()).add((expert, part))
