"""Where an adapter comes from: a PEFT directory (adapter.py) or llama.cpp's LoRA GGUF file
(gguf_adapter.py), both read into the same LoraAdapter. The one place that tells them apart."""
from __future__ import annotations

import torch

from .adapter import LoraAdapter, load_peft_adapter
from .gguf_adapter import is_gguf_file, load_gguf_adapter
from .targets import LoraTarget


def load_adapter(name: str, path: str, targets: dict[tuple[str, int], LoraTarget], max_rank: int,
                 dtype: torch.dtype, uid: int = 0) -> LoraAdapter:
    """The adapter at `path`, read and checked against the model's targets (LoraAdapterError);
    nothing is kept on error."""
    if is_gguf_file(path):
        return load_gguf_adapter(name, path, targets, max_rank, dtype, uid)
    return load_peft_adapter(name, path, targets, max_rank, dtype, uid)
