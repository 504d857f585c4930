"""Hugging Face directories: config.json, generation_config.json and *.safetensors
(sharded or not), read tensor by tensor with safetensors' safe_open."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

import torch


def load_hf_config(path: str) -> Any:
    """A transformers config from a model directory or a config .json file."""
    from transformers import AutoConfig

    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path)
    with open(path) as f:
        config_dict = json.load(f)
    if "model_type" not in config_dict:
        raise ValueError(f"{path!r} has no model_type; is it a transformers config.json?")
    return AutoConfig.for_model(**config_dict)


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


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every file."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
