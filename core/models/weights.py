"""Checkpoint tensors into a native model's parameters, by Hugging Face name.

Linear and embedding layers read their own slice of each tensor (`load` / `load_shard`
in core/layers/linear.py: all of it unsharded, this shard's rows or columns under tensor
parallelism); any other parameter (norms, routers) is replicated and copied whole. The
tensors may be lazy (the loader's safetensors slices), so a shard reads only its slices.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from ..layers.linear import Embedding, Linear, read_whole

IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


def load_checkpoint_weights(model: nn.Module, weights: Iterable[tuple[str, Any]],
                            stacked: dict[str, tuple[str, int]], tied_lm_head: bool) -> set[str]:
    """stacked: Hugging Face projection name -> (our fused projection, part index).
    Returns the names of the parameters now fully loaded; a name the model lacks raises."""
    params = dict(model.named_parameters())
    parts_loaded: dict[str, set[int]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(IGNORED_WEIGHT_SUFFIXES) or (name == "lm_head.weight" and tied_lm_head):
            continue
        fused = _fused_name(name, stacked)
        if fused is not None:
            param_name, part = fused
            module = model.get_submodule(param_name.rsplit(".", 1)[0])
            module.load_shard(_param(params, param_name), part, tensor)
            parts_loaded.setdefault(param_name, set()).add(part)
            if len(parts_loaded[param_name]) == len(module.output_sizes):
                loaded.add(param_name)
            continue
        module_name, _, leaf = name.rpartition(".")
        module = _module(model, module_name)
        if isinstance(module, (Linear, Embedding)):
            if module.load(leaf, tensor):
                loaded.add(_present(params, name))
            continue
        param = _param(params, name)
        tensor = read_whole(tensor)
        if param.shape != tensor.shape:
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        loaded.add(name)
    return loaded


def _fused_name(name: str, stacked: dict[str, tuple[str, int]]) -> tuple[str, int] | None:
    for hf_name, (fused, part) in stacked.items():
        if f".{hf_name}." in name:
            return name.replace(f".{hf_name}.", f".{fused}."), part
    return None


def _module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _present(params: dict[str, nn.Parameter], name: str) -> str:
    _param(params, name)
    return name


def _param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"checkpoint weight {name!r} has no matching parameter in the model")
    return params[name]
