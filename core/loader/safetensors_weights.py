"""Hugging Face directories: config.json, generation_config.json and *.safetensors
(sharded or not), read tensor by tensor with safetensors' safe_open."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

import torch


def load_hf_config(path: str, trust_remote_code: bool = False) -> Any:
    """A transformers config from a model directory or a config .json file. A model_type
    transformers does not know is refused (UnsupportedModelError) unless the directory
    brings its own code (config.auto_map) and the caller trusts it."""
    from transformers import AutoConfig

    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(config_file) as f:
        config_dict = json.load(f)
    if "model_type" not in config_dict:
        raise ValueError(f"{config_file!r} has no model_type; is it a transformers config.json?")
    remote = _check_model_type(config_dict, trust_remote_code)
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path, trust_remote_code=remote)
    if remote:
        raise ValueError(f"{path!r}: a config with its own code loads from its model directory, not a bare file")
    return AutoConfig.for_model(**config_dict)


def _check_model_type(config_dict: dict, trust_remote_code: bool) -> bool:
    """Whether the config needs its own code (allowed only when trusted)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from ..models import UnsupportedModelError, supported_summary

    model_type = config_dict["model_type"]
    if model_type in CONFIG_MAPPING_NAMES:
        return False
    architecture = (config_dict.get("architectures") or [model_type])[0]
    if "AutoConfig" not in (config_dict.get("auto_map") or {}):
        raise UnsupportedModelError(f"model {architecture} ({model_type}) is an architecture neither Switchyard "
                                    f"nor transformers knows; Switchyard runs {supported_summary()}")
    if not trust_remote_code:
        raise UnsupportedModelError(f"model {architecture} ({model_type}) needs the checkpoint's own code "
                                    "(config.auto_map); pass --trust-remote-code to run it")
    return True


def generation_eos_token_ids(directory: str) -> Any:
    """eos_token_id of generation_config.json (int, list or None)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("eos_token_id")


def safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, name) for name in names]
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def count_safetensors_weights(files: list[str]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            total += len(f.keys())
    return total


class LazyTensor:
    """A checkpoint tensor not read yet (core.layers.linear.CheckpointTensor): `narrow`
    reads only that slice from the file (safe_open's get_slice). Valid while its file is
    open, i.e. until iterate_safetensors moves on to the next tensor."""

    def __init__(self, handle):
        self._slice = handle
        self.shape = torch.Size(handle.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def iterate_safetensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """(name, CPU tensor) for every tensor of every file; lazy: (name, LazyTensor), so that
    a shard reads only its slices (consume each before asking for the next)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, LazyTensor(f.get_slice(name)) if lazy else f.get_tensor(name)
