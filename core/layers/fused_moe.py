"""Mixture-of-experts feed-forward: top-k routing and the experts of one layer run as
batched matmuls over the step's tokens grouped by expert, never a loop over tokens.

Expert weights are stacked at load: w13 [E, 2*I, H] (gate rows then up rows, fused like
MergedLinear's gate_up_proj) and w2 [E, H, I]. `fused_experts` is the plain-torch
path (the reference, and the CPU path): sort the (token, expert) pairs by expert, run
one gate_up matmul and one down matmul per expert that received tokens, and add the
weighted outputs back per token with index_add_. A backend may point a FusedMoE's
`experts_impl` at a fused kernel with the same contract (backends/cuda/kernels/moe.py).
Under tensor parallelism each shard holds a slice of every expert's intermediate
dimension (`rows`), and its output is a partial sum (the decoder layer reduces it).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .linear import CheckpointTensor, Slice, read_slice, read_whole

ExpertsImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64): softmax in
    float32, top-k, renormalised to sum 1 if asked (Mixtral always; Qwen-MoE's norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights / topk_ids [T, k]
    -> sum over k of weight * down(silu(gate(x)) * up(x)), [T, H] in hidden's dtype.
    Each token's k contributions are added in expert order whatever the batch."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, tokens in order
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of_pair = order // top_k
    pair_weights = topk_weights.reshape(-1)[order].to(torch.float32)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:  # experts without tokens cost nothing
            continue
        tokens = token_of_pair[start:start + count]
        gate_up = F.linear(hidden[tokens], w13[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, down.to(torch.float32) * pair_weights[start:start + count, None])
        start += count
    return out.to(hidden.dtype)


class FusedMoE(nn.Module):
    """The routed experts of one layer (router outside: the model computes its logits)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int | Slice,
                 renormalize: bool, dtype: torch.dtype | None = None):
        """intermediate_size: every expert's, or the Slice of it this shard holds."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.rows = intermediate_size if isinstance(intermediate_size, Slice) else Slice.whole(intermediate_size)
        self.intermediate_size = intermediate_size = self.rows.size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        self.experts_impl: ExpertsImpl = fused_experts  # a backend may swap in a fused kernel

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.experts_impl(hidden, self.w13_weight, self.w2_weight, weights, ids)

    def load_expert(self, expert: int | None, part: str, tensor: CheckpointTensor) -> None:
        """part: "gate" / "up" (rows of w13), "gate_up" (all of w13) or "down" (w2), as
        [out, in] of one expert, or stacked [E, out, in] for every expert (expert None);
        this shard's slice of the intermediate dimension is read."""
        size, rows = self.intermediate_size, self.rows
        if part == "gate_up":  # [E, 2 * full, H]: this shard's gate rows and up rows
            tensor = torch.cat([read_slice(tensor, -2, rows, 0), read_slice(tensor, -2, rows, rows.full)], -2)
        elif part in ("gate", "up"):
            tensor = read_slice(tensor, -2, rows)
        elif part == "down":
            tensor = read_slice(tensor, -1, rows)
        tensor = read_whole(tensor)
        experts = slice(None) if expert is None else expert
        target = {"gate": self.w13_weight.data[experts, :size], "up": self.w13_weight.data[experts, size:],
                  "gate_up": self.w13_weight.data[experts], "down": self.w2_weight.data[experts]}[part]
        if tensor.shape != target.shape:
            which = "experts" if expert is None else f"expert {expert}"
            raise ValueError(f"{which} {part} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)
