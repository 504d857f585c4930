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
Checkpoints come with one tensor per expert (`...experts.{e}.gate_proj.weight`) or stacked
over experts: `...experts.gate_up_proj` / `...experts.down_proj` as transformers 5 keeps
them in memory, or `...experts.gate_proj` / `up_proj` / `down_proj` as GGUF files hold them
(llama.cpp's ffn_gate_exps / ffn_up_exps / ffn_down_exps).
Tensor parallelism: every shard holds every expert, each with its slice of the expert's
intermediate dimension (and of the shared expert's); the router and the shared expert's
gate are replicated, and the block's partial sums are reduced by the decoder layer.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from ..layers import Linear, SiluAndMul
from ..layers.fused_moe import FusedMoE
from ..layers.parallel import NO_TP, TensorParallel, merged_column_parallel, row_parallel
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

# One expert's tensor, or every expert's stacked ([E, out, in], no expert index).
EXPERT_WEIGHT = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
STACKED_EXPERT_WEIGHT = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
EXPERT_PARTS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down",
                "gate_up_proj": "gate_up"}


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) of a given width (Qwen2-MoE's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        self.gate_up_proj = merged_column_parallel(hidden_size, (intermediate_size, intermediate_size), False,
                                                   dtype, tp)
        self.act = SiluAndMul()
        self.down_proj = row_parallel(intermediate_size, hidden_size, False, dtype, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert)."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel = NO_TP):
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        is_mixtral = config.model_type == "mixtral"
        num_experts = config.num_local_experts if is_mixtral else config.num_experts
        expert_size = config.intermediate_size if is_mixtral else config.moe_intermediate_size
        renormalize = is_mixtral or bool(config.norm_topk_prob)
        self.gate = Linear(config.hidden_size, num_experts, dtype=dtype)
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                tp.padded_split(expert_size),
                                renormalize, dtype=dtype)
        self.shared_expert = self.shared_expert_gate = None
        shared_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if shared_size:
            self.shared_expert = GatedMLP(config.hidden_size, shared_size, dtype, tp)
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
    def build_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        return SparseMoeBlock(config, dtype, tp) if is_sparse_layer(config, layer_idx) else LlamaMLP(config, dtype, tp)


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
            one, stacked = EXPERT_WEIGHT.match(name), STACKED_EXPERT_WEIGHT.match(name)
            if one is None and stacked is None:
                yield name, tensor
                continue
            if one is not None:
                layer, expert, part = one[1], int(one[2]), EXPERT_PARTS[one[3]]
            else:
                layer, expert, part = stacked[1], None, EXPERT_PARTS[stacked[2]]
            prefix = f"{layer}.mlp.experts"
            module = self.get_submodule(prefix)
            if not isinstance(module, FusedMoE) or (expert is not None and expert >= module.num_experts):
                raise ValueError(f"checkpoint weight {name!r} has no matching expert in the model")
            module.load_expert(expert, part, tensor)
            parts = ("gate", "up") if part == "gate_up" else (part,)
            covered = range(module.num_experts) if expert is None else (expert,)
            expert_parts.setdefault(prefix, set()).update((e, p) for e in covered for p in parts)
