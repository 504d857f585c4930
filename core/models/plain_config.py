"""A model's config as plain attributes, read without transformers.

transformers' config classes fill every value a checkpoint leaves out, but importing one costs
an engine ~75 MiB of resident memory for the rest of its life (`LlamaConfig` pulls in
`transformers.activations`, which imports torch.distributed.tensor and sympy), and a start the
time to import them. A GGUF's converted metadata (core/loader/gguf_cache.py) is made by transformers once;
it keeps, beside transformers' own config.json, every attribute the config class set (aliases
included) in `PLAIN_CONFIG_FILE`, and a cached start reads that into a PlainConfig.

The native models read configs by attribute (with getattr defaults for what only some
model types have), which is all a PlainConfig offers. Code that needs transformers' own class
(the transformers fallback, transformers' GGUF name mapping) asks `transformers_config`.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any

PLAIN_CONFIG_FILE = "plain_config.json"


class PlainConfig:
    """Attribute access over a config's full dict; a missing attribute raises AttributeError,
    as it does on transformers' classes, so `getattr(config, key, default)` reads the same."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(copy.deepcopy(values))

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def __repr__(self) -> str:
        return f"PlainConfig(model_type={self.__dict__.get('model_type')!r})"


def write_plain_config(config: Any, directory: str) -> None:
    """Keep `config` (transformers' PretrainedConfig) as every attribute its class set, plus the
    class's aliases (e.g. Mixtral's num_experts for num_local_experts)."""
    values = json.loads(config.to_json_string(use_diff=False))
    for alias, name in type(config).attribute_map.items():
        values.setdefault(alias, values.get(name))
    with open(os.path.join(directory, PLAIN_CONFIG_FILE), "w") as file:
        json.dump(values, file)


def read_plain_config(directory: str) -> PlainConfig | None:
    """The PlainConfig kept in `directory`, named after it as transformers' from_pretrained names
    a config (`_name_or_path`); None when there is none."""
    path = os.path.join(directory, PLAIN_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        return PlainConfig({**json.load(file), "_name_or_path": directory})


def transformers_config(config: Any) -> Any:
    """transformers' config class for `config` (itself when it is one already)."""
    if not isinstance(config, PlainConfig):
        return config
    from transformers import AutoConfig

    values = config.to_dict()
    values.pop("_name_or_path", None)  # as load_gguf_config leaves it
    return AutoConfig.for_model(values.pop("model_type"), **values)
