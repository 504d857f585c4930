"""The resident adapters' weights of one target, stacked by slot: what the kernel reads.

a [S, R, in] and b [S, out, R] (S = max_loras slots, R = max_lora_rank; an adapter of rank r
fills the first r of R, the rest stays zero), scales [S] float32. The embedding's A is kept
transposed, [S, vocab, R], so a token's row of it is one gather. A slot whose adapter does not
target this layer has scale 0 and zeros, and adds nothing. The parts of a fused projection (q/k/v,
gate/up) read one input: their A stacks are views of one [S, parts * R, in] tensor (`make_stacks`),
so one shrink serves them all.
"""
from __future__ import annotations

import torch

from .adapter import TargetWeights
from .targets import LoraTarget, TargetKind


class LoraStack:
    def __init__(self, target: LoraTarget, num_slots: int, rank: int, dtype: torch.dtype, device: torch.device,
                 shared_a: torch.Tensor | None = None):
        """`shared_a`: the A stacks of every part of the target's fused projection, [S, parts * R, in];
        this part's A is its rows [part * R, (part + 1) * R)."""
        self.target = target
        self.shared_a = shared_a
        if shared_a is not None:
            self.a = shared_a[:, target.part * rank:(target.part + 1) * rank]
        elif target.kind is TargetKind.EMBEDDING:
            self.a = torch.zeros((num_slots, target.in_features, rank), dtype=dtype, device=device)
        else:
            self.a = torch.zeros((num_slots, rank, target.in_features), dtype=dtype, device=device)
        self.b = torch.zeros((num_slots, target.out_features, rank), dtype=dtype, device=device)
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)

    @staticmethod
    def nbytes_of(target: LoraTarget, num_slots: int, rank: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return num_slots * rank * (target.in_features + target.out_features) * element + num_slots * 4

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.scales))

    def write(self, slot: int, weights: TargetWeights | None) -> None:
        """Slot `slot` holds `weights` (None: an adapter that does not target this layer)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if weights is None:
            self.scales[slot] = 0.0
            return
        rank = weights.rank
        if self.target.kind is TargetKind.EMBEDDING:
            self.a[slot, :, :rank].copy_(weights.a.t())
        else:
            self.a[slot, :rank].copy_(weights.a)
        self.b[slot, :, :rank].copy_(weights.b)
        self.scales[slot] = weights.scale


def make_stacks(targets: dict[tuple[str, int], LoraTarget], num_slots: int, rank: int, dtype: torch.dtype,
                device: torch.device) -> dict[tuple[str, int], LoraStack]:
    """A stack for each target; the parts of one fused projection share one A tensor."""
    parts: dict[str, list[LoraTarget]] = {}
    for key in sorted(targets):
        parts.setdefault(key[0], []).append(targets[key])
    stacks = {}
    for module_parts in parts.values():
        shared = None
        if len(module_parts) > 1:
            shared = torch.zeros((num_slots, len(module_parts) * rank, module_parts[0].in_features), dtype=dtype,
                                 device=device)
        for target in module_parts:
            stacks[target.key] = LoraStack(target, num_slots, rank, dtype, device, shared)
    return stacks
