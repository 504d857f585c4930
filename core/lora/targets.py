"""Which of a model's layers an adapter may change, and how a PEFT module name maps onto them.

Our models fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (core/models/llama.py
STACKED_PARAMS); PEFT names the unfused Hugging Face modules. A target is one column range of one
of our modules: `model.layers.0.self_attn.q_proj` is part 0 of `model.layers.0.self_attn.qkv_proj`.
Targets are read from the model as loaded, before a backend's prepare_model swaps its layers for
kernels (which keep the shapes but not the fused parts); the wrappers go on afterwards (layers.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import nn

from ..layers.linear import Embedding, Linear, MergedLinear
from ..models.llama import STACKED_PARAMS

# our module names (the last component) whose output an adapter may add to
LINEAR_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
EMBEDDING_MODULE = "embed_tokens"
HEAD_MODULE = "lm_head"
PEFT_PREFIX = "base_model.model."


class TargetKind(enum.Enum):
    LINEAR = "linear"  # a decoder layer's projection (or a part of a fused one)
    EMBEDDING = "embedding"  # the token embedding (PEFT's lora_embedding_A/B)
    HEAD = "head"  # the output projection: applied to the rows whose logits are computed


@dataclass(frozen=True)
class LoraTarget:
    """One column range [start, stop) of one module's output, and the input width it reads."""

    module: str  # our module path, e.g. model.layers.0.self_attn.qkv_proj
    part: int  # the part of a fused projection (0 for an unfused one)
    kind: TargetKind
    in_features: int  # the vocabulary size for the embedding
    start: int
    stop: int
    head_dim: int = 0  # the attention's head size, for the q/k/v parts (llama.cpp's row order, gguf_adapter.py)

    @property
    def out_features(self) -> int:
        return self.stop - self.start

    @property
    def key(self) -> tuple[str, int]:
        return self.module, self.part


def find_targets(model: nn.Module) -> dict[tuple[str, int], LoraTarget]:
    """Every (module, part) an adapter may target in `model` as loaded (before prepare_model)."""
    targets: dict[tuple[str, int], LoraTarget] = {}
    head = model.output_head() if hasattr(model, "output_head") else None
    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if isinstance(module, MergedLinear) and leaf in LINEAR_MODULES:
            start = 0
            parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
            head_dim = int(getattr(parent, "head_dim", 0) or 0) if leaf == "qkv_proj" else 0
            for part, size in enumerate(module.output_sizes):
                targets[(path, part)] = LoraTarget(path, part, TargetKind.LINEAR, module.in_features, start,
                                                   start + size, head_dim)
                start += size
        elif isinstance(module, Linear) and (leaf in LINEAR_MODULES or module is head):
            kind = TargetKind.HEAD if module is head else TargetKind.LINEAR
            targets[(path, 0)] = LoraTarget(path, 0, kind, module.in_features, 0, module.out_features)
        elif isinstance(module, Embedding) and leaf == EMBEDDING_MODULE:
            rows = module.weight.shape[0] if module.quantized is None else module.quantized.shape[0]
            targets[(path, 0)] = LoraTarget(path, 0, TargetKind.EMBEDDING, rows, 0, module.weight.shape[1]
                                            if module.quantized is None else module.quantized.shape[1])
    return targets


def peft_target(peft_module: str) -> tuple[str, int]:
    """Our (module, part) of a PEFT module name (`base_model.model.` stripped if present):
    `model.layers.0.self_attn.k_proj` -> (`model.layers.0.self_attn.qkv_proj`, 1)."""
    name = peft_module.removeprefix(PEFT_PREFIX)
    parent, _, leaf = name.rpartition(".")
    if leaf in STACKED_PARAMS:
        fused, part = STACKED_PARAMS[leaf]
        return (f"{parent}.{fused}" if parent else fused), part
    return name, 0


_UNFUSED = {(fused, part): leaf for leaf, (fused, part) in STACKED_PARAMS.items()}


def hf_module(key: tuple[str, int]) -> str:
    """The Hugging Face module name of one of our targets (peft_target's inverse):
    (`model.layers.0.self_attn.qkv_proj`, 1) -> `model.layers.0.self_attn.k_proj`."""
    module, part = key
    parent, _, leaf = module.rpartition(".")
    unfused = _UNFUSED.get((leaf, part))
    if unfused is None:
        return module
    return f"{parent}.{unfused}" if parent else unfused
