"""llama.cpp's LoRA adapter file (convert_lora_to_gguf.py's output), read into the LoraAdapter a
PEFT directory gives (adapter.py), so everything after reading is the same.

The format: general.type "adapter", adapter.type "lora", adapter.lora.alpha (one alpha for every
tensor); per targeted weight `<llama.cpp name>.lora_a` (PEFT's A [r, in]) and `.lora_b` (B [out, r])
in any type the `gguf` package dequantizes (F32, F16, BF16, Q8_0). What the converter does to
them, undone here:
- names: gguf-py's table (TensorNameMap) of the file's architecture maps our targets' Hugging Face
  names to llama.cpp's (`model.layers.3.self_attn.q_proj` -> `blk.3.attn_q`);
- token_embd's lora_a is stored transposed ([vocab, r]);
- for architectures whose q/k rows llama.cpp permutes (llama: the converter permutes q_proj /
  k_proj and, for an adapter, their lora_b rows), the rows are put back, as the base GGUF loader
  does (core/loader/gguf_processors.py).
Each target's scale is llama.cpp's (llama-adapter.h get_scale): alpha / r, or 1 when alpha is 0.
llama.cpp skips mergekit's norm vectors (`*_norm.weight`); so does this reader. Activated LoRA
(adapter.alora.invocation_tokens) and unknown tensors are refused, with LoraAdapterError as for a
PEFT directory, before anything is kept.
"""
from __future__ import annotations

import logging
import os
import re

import numpy as np
import torch

from ..loader.gguf_processors import LLAMA, TRANSFORMERS, processor_kind, unpermute
from .adapter import LoraAdapter, LoraAdapterError, TargetWeights, check_pair
from .targets import LoraTarget, TargetKind, hf_module

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUFFIX = ".gguf"
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def is_gguf_file(path: str) -> bool:
    """Whether `path` is a file meant as a GGUF adapter: named .gguf, or starting with GGUF's magic."""
    real = os.path.realpath(path)
    if not os.path.isfile(real):
        return False
    if real.lower().endswith(SUFFIX):
        return True
    try:
        with open(real, "rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _field(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _values(tensor) -> torch.Tensor:
    """A GGUF tensor as float32, in numpy's (PyTorch's) order: the reverse of GGUF's ne."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True))


def gguf_names(architecture: str, targets: dict[tuple[str, int], LoraTarget]) -> dict[str, tuple[str, int]]:
    """llama.cpp's tensor name (without .weight) -> our target, for every target of the model."""
    import gguf

    arch = {value: key for key, value in gguf.MODEL_ARCH_NAMES.items()}.get(architecture)
    if arch is None:
        return {}
    layers = [int(m[1]) for key in targets if (m := _LAYER.search(f".{key[0]}."))]
    table = gguf.get_tensor_name_map(arch, 1 + max(layers, default=0))
    names = {}
    for key in targets:
        name = table.get_name(hf_module(key))
        if name is not None:
            names[name] = key
    return names


def _read(name: str, path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # the gguf package raises ValueError, struct.error, IndexError, ... on a bad file
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path!r} cannot be read as a GGUF file: {exc}") from exc


def _header(name: str, reader) -> tuple[str, float]:
    """(architecture, alpha) of a llama.cpp LoRA adapter, or LoraAdapterError."""
    from gguf import Keys

    general_type = _field(reader, Keys.General.TYPE)
    if general_type != "adapter":
        raise LoraAdapterError(f"LoRA adapter {name!r}: the GGUF file is not an adapter ({Keys.General.TYPE} is "
                               f"{general_type!r}, not 'adapter'): a model file cannot be served as an adapter")
    adapter_type = _field(reader, Keys.Adapter.TYPE)
    if adapter_type != "lora":
        raise LoraAdapterError(f"LoRA adapter {name!r}: the GGUF adapter is not LoRA ({Keys.Adapter.TYPE} is "
                               f"{adapter_type!r})")
    if reader.get_field(Keys.Adapter.ALORA_INVOCATION_TOKENS) is not None:
        raise LoraAdapterError(f"LoRA adapter {name!r}: activated LoRA ({Keys.Adapter.ALORA_INVOCATION_TOKENS}) "
                               "is not supported")
    alpha = _field(reader, Keys.Adapter.LORA_ALPHA)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not np.isfinite(alpha):
        raise LoraAdapterError(f"LoRA adapter {name!r}: the GGUF adapter has no number "
                               f"{Keys.Adapter.LORA_ALPHA} (got {alpha!r})")
    architecture = _field(reader, Keys.General.ARCHITECTURE)
    if not isinstance(architecture, str):
        raise LoraAdapterError(f"LoRA adapter {name!r}: the GGUF adapter has no {Keys.General.ARCHITECTURE}")
    return architecture, float(alpha)


def load_gguf_adapter(name: str, path: str, targets: dict[tuple[str, int], LoraTarget], max_rank: int,
                      dtype: torch.dtype, uid: int = 0) -> LoraAdapter:
    """Reads and checks llama.cpp's LoRA GGUF file at `path`; nothing is kept on error."""
    real = os.path.realpath(path)
    reader = _read(name, real)
    architecture, alpha = _header(name, reader)
    kind = processor_kind(architecture)
    if kind == TRANSFORMERS:
        raise LoraAdapterError(f"LoRA adapter {name!r}: GGUF adapters of architecture {architecture!r} are not "
                               "supported (llama.cpp transforms its tensors)")
    names = gguf_names(architecture, targets)
    pairs: dict[str, dict[str, object]] = {}
    skipped = []
    for tensor in reader.tensors:
        if tensor.name.endswith("_norm.weight"):
            skipped.append(tensor.name)  # mergekit's norm vectors: llama.cpp skips them too
            continue
        base, _, which = tensor.name.rpartition(".")
        if which not in ("lora_a", "lora_b"):
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {tensor.name!r} is not a lora_a or lora_b matrix")
        pairs.setdefault(base, {})[which] = tensor
    if skipped:
        logger.warning("LoRA adapter %r: %d norm vectors skipped, as llama.cpp skips them (%s, ...)", name,
                       len(skipped), skipped[0])
    if not pairs:
        raise LoraAdapterError(f"LoRA adapter {name!r}: the GGUF adapter holds no LoRA weights")
    weights: dict[tuple[str, int], TargetWeights] = {}
    for base, pair in sorted(pairs.items()):
        if set(pair) != {"lora_a", "lora_b"}:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {base} has {sorted(pair)}, not lora_a and lora_b")
        key = names.get(base.removesuffix(".weight"))
        if key is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {base} ({architecture}) is not a layer an adapter "
                                   "may target on this model (q/k/v/o_proj, gate/up/down_proj, embed_tokens, lm_head)")
        target = targets[key]
        a, b = _values(pair["lora_a"]), _values(pair["lora_b"])
        if target.kind is TargetKind.EMBEDDING:
            a = a.t()  # the converter stores token_embd's A transposed
        check_pair(name, f"{base} ({hf_module(key)})", target, a, b, max_rank)
        if kind == LLAMA and key[0].endswith("qkv_proj") and key[1] in (0, 1):  # q, k: llama.cpp's row order undone
            if not target.head_dim:
                raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {base}'s rows are in llama.cpp's order and "
                                       "this model's head size is unknown")
            b = torch.from_numpy(unpermute(b.numpy(), b.shape[0] // target.head_dim))
        scale = alpha / a.shape[0] if alpha else 1.0
        weights[key] = TargetWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scale))
    return LoraAdapter(name, real, uid, weights, frozenset(targets[k].kind for k in weights))
