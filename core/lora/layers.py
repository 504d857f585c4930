"""The model's layers with the step's adapters added: forward(x) = base(x) + each part's delta.

Put on after the backend's prepare_model, around whatever module it left (a float Linear, a
oneDNN-packed one, a block-format or GPTQ/AWQ/bitsandbytes kernel), so the base product is
the backend's own. The delta of each part of a fused projection (q/k/v, gate/up) is added to
its column slice of the output, in place: kernel.shrink (x @ A.T per token's slot; one for all
the parts, whose A stacks are one tensor, stacks.py) then kernel.expand (+ scale * h @ B.T). The
step's LoraBatch comes from the shared LoraContext (context.py); with none (no adapter token in the
step) a layer is its base layer. Measured: benchmarks/lora_steps.py.
"""
from __future__ import annotations

import torch
from torch import nn

from .context import LoraContext
from .stacks import LoraStack
from .targets import TargetKind


class _Wrapper(nn.Module):
    """A layer with the adapters' deltas: `base` is the module it wraps, whose attributes it shows."""

    def __init__(self, base: nn.Module, context: LoraContext):
        super().__init__()
        self.base = base
        self.context = context

    def __getattr__(self, name: str):
        """What the wrapped module holds (in_features, weight, ...), for code that reads it."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)


class LoraLinear(_Wrapper):
    """A projection (or the output head) with its parts' stacks."""

    def __init__(self, base: nn.Module, stacks: list[LoraStack], context: LoraContext):
        super().__init__(base, context)
        self.stacks = stacks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.context.batch
        if batch is None:
            return y
        kernel = self.context.kernel
        shared = self.stacks[0].shared_a  # a fused projection's parts: one shrink for all of them
        h_all = kernel.shrink(x, shared, batch) if shared is not None else None
        for stack in self.stacks:
            target = stack.target
            if h_all is None:
                h = kernel.shrink(x, stack.a, batch)
            else:
                rank = stack.a.shape[1]
                h = h_all[:, target.part * rank:(target.part + 1) * rank].contiguous()
            out = y if target.start == 0 and target.stop == y.shape[-1] else y[:, target.start:target.stop]
            kernel.expand(out, h, stack.b, stack.scales, batch)
        return y

class LoraEmbedding(_Wrapper):
    """The token embedding with each adapter token's delta row: scale * B[s] @ A[s][:, id]."""

    def __init__(self, base: nn.Module, stack: LoraStack, context: LoraContext):
        super().__init__(base, context)
        self.stack = stack

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base(ids)
        batch = self.context.batch
        if batch is None:
            return y
        stack = self.stack
        h = stack.a[batch.token_slots.clamp(min=0).long(), ids]  # [T, R]; rows of the base model unused
        self.context.kernel.expand(y, h.to(y.dtype), stack.b, stack.scales, batch)
        return y


def wrap_model(model: nn.Module, stacks: dict[tuple[str, int], LoraStack], context: LoraContext) -> int:
    """Replaces each targeted module of `model` by its wrapper; returns how many were wrapped."""
    by_module: dict[str, list[LoraStack]] = {}
    for (module, _), stack in sorted(stacks.items()):
        by_module.setdefault(module, []).append(stack)
    for path, module_stacks in by_module.items():
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        if module_stacks[0].target.kind is TargetKind.EMBEDDING:
            wrapper: nn.Module = LoraEmbedding(base, module_stacks[0], context)
        else:
            wrapper = LoraLinear(base, module_stacks, context)
        setattr(parent, child, wrapper)
    return len(by_module)
