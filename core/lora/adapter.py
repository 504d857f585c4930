"""A PEFT LoRA adapter read from its directory and checked against the served model (llama.cpp's
LoRA GGUF files are read by gguf_adapter.py into the same LoraAdapter).

The directory holds adapter_config.json and adapter_model.safetensors (a pickled
adapter_model.bin is refused: loading it would run code from the file). Every tensor is mapped
onto one of the model's targets (targets.py); each target's delta is scale * B @ A with
scale = alpha / r, or alpha / sqrt(r) with use_rslora, where rank_pattern / alpha_pattern (PEFT's
per-module overrides) give a module its own r and alpha. Anything not plain LoRA (DoRA, a
trained bias, modules saved whole, ...) is refused. All of it is checked before anything is
kept: a bad adapter raises one LoraAdapterError naming what is wrong, and changes nothing.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from ..errors import ValidationError
from .targets import LoraTarget, TargetKind, peft_target

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

# adapter_config.json options that change what a LoRA computes, which are refused when set
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)", "lora_bias": "a bias in lora_B (lora_bias)",
    "modules_to_save": "modules saved whole (modules_to_save)",
    "trainable_token_indices": "trained token rows (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)", "target_parameters": "target_parameters",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "use_qalora": "QALoRA (use_qalora)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)", "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
# tensor names: <module>.lora_A.weight, <module>.lora_embedding_A, optionally with an adapter name
_TENSOR = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
                     r"(?:\.[A-Za-z0-9_-]+)?(?:\.weight)?$")


class LoraAdapterError(ValidationError):
    """An adapter that cannot be served over this model (one line: which adapter, what is wrong)."""


@dataclass(frozen=True)
class TargetWeights:
    """One target's low-rank pair: a [r, in] and b [out, r] (the embedding's a is [r, vocab])."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter held in host memory; `uid` tells apart two loads under one name (the prefix
    cache's salt, manager.py)."""

    name: str
    path: str
    uid: int
    weights: dict[tuple[str, int], TargetWeights] = field(repr=False)
    kinds: frozenset[TargetKind] = frozenset()  # what it targets: decoder projections, embedding, head

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.weights.values())

    @property
    def nbytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
                   for w in self.weights.values())


def adapter_directory(name: str, path: str) -> str:
    """The adapter's real directory (symlinks resolved), or LoraAdapterError."""
    real = os.path.realpath(path)
    if not os.path.exists(real):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path!r} does not exist"
                               + (f" (it resolves to {real!r})" if real != os.path.abspath(path) else ""))
    if not os.path.isdir(real):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path!r} is not a directory (a PEFT adapter is a "
                               f"directory with {CONFIG_FILE} and {WEIGHTS_FILE}; llama.cpp's is a .gguf file)")
    return real


def read_config(name: str, directory: str) -> dict:
    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {directory!r}")
    try:
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraAdapterError(f"LoRA adapter {name!r}: peft_type {peft_type} is not LoRA")
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise LoraAdapterError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    return config


def read_tensors(name: str, directory: str) -> dict[str, torch.Tensor]:
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        pickled = [f for f in PICKLED_FILES if os.path.isfile(os.path.join(directory, f))]
        if pickled:
            raise LoraAdapterError(f"LoRA adapter {name!r}: only {pickled[0]} (a pickle) is there; pickles are not "
                                   f"loaded (they can run code): save it as {WEIGHTS_FILE}")
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {directory!r}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(weights_path)
    except (OSError, SafetensorError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read: {exc}") from exc


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule (peft.utils.other.get_pattern_key): the first pattern that matches the end of
    the module's name (after a dot) gives its value."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def check_pair(name: str, module: str, target: LoraTarget, a: torch.Tensor, b: torch.Tensor, max_rank: int) -> None:
    """LoraAdapterError unless a [r, in] and b [out, r] fit `target` with r at most `max_rank`."""
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank or a.shape[1] != target.in_features \
            or b.shape[0] != target.out_features:
        raise LoraAdapterError(
            f"LoRA adapter {name!r}: module {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model "
            f"needs A [r, {target.in_features}] and B [{target.out_features}, r]")
    if rank > max_rank:
        raise LoraAdapterError(f"LoRA adapter {name!r}: module {module} has rank {rank}, more than the "
                               f"largest rank served, {max_rank} (--max-lora-rank)")


def load_peft_adapter(name: str, path: str, targets: dict[tuple[str, int], LoraTarget], max_rank: int,
                      dtype: torch.dtype, uid: int = 0) -> LoraAdapter:
    """Reads and checks the PEFT adapter directory at `path` against the model's targets; nothing
    is kept on error."""
    directory = adapter_directory(name, path)
    config = read_config(name, directory)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in read_tensors(name, directory).items():
        if ".base_layer." in tensor_name:
            continue  # PEFT's copy of a targeted embedding or head as it was: the model's own weights
        if "lora_magnitude_vector" in tensor_name:
            raise LoraAdapterError(f"LoRA adapter {name!r}: DoRA ({tensor_name}) is not supported")
        match = _TENSOR.match(tensor_name)
        if match is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {tensor_name!r} is not a LoRA A or B matrix")
        which = match["which"].replace("lora_embedding_", "lora_")
        pairs.setdefault(match["module"].removeprefix("base_model.model."), {})[which] = tensor
    if not pairs:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    rslora = bool(config.get("use_rslora", False))
    weights: dict[tuple[str, int], TargetWeights] = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraAdapterError(f"LoRA adapter {name!r}: module {module} has {sorted(pair)}, not lora_A and lora_B")
        key = peft_target(module)
        target = targets.get(key)
        if target is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: target module {module} is not supported on this model "
                                   f"(supported: q/k/v/o_proj, gate/up/down_proj, embed_tokens, lm_head)")
        a, b = pair["lora_A"], pair["lora_B"]  # an embedding's: A [r, vocab], B [dim, r], as a Linear's
        check_pair(name, module, target, a, b, max_rank)
        rank = a.shape[0]
        r = _pattern_value(config.get("rank_pattern"), module, config.get("r", rank))
        if r != rank:
            raise LoraAdapterError(f"LoRA adapter {name!r}: module {module} has rank {rank}, its config says {r}")
        alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", rank))
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        if key in weights:
            raise LoraAdapterError(f"LoRA adapter {name!r}: module {module} appears twice")
        weights[key] = TargetWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scale))
    return LoraAdapter(name, directory, uid, weights, frozenset(targets[k].kind for k in weights))
