"""LoRA on a loaded model, in the loader's order (core/engine/shard_worker.py build_shard_model):

1. `find_targets` before the backend's prepare_model (which swaps layers for kernels that keep
   shapes, not fused parts);
2. `attach_lora` after it and before the KV cache is sized: the adapters named at start are read
   and checked, the stacks allocated (their bytes come off --kv-cache-memory, and a device
   backend measures its free memory after them). It returns the LoraManager the engine and the
   runner share;
3. `wrap_layers` once the runner is built: the targeted layers wrapped (layers.py). A backend's
   own path (graphs) took the layers as they were, and runs the steps without adapter rows; the
   others run the wrapped layers (core/execution/decode_batch.py). The CPU's fused C++ layers take
   the wrappers' stacks once the loader sets the runner's `lora` (backends/cpu/fused_decode.py
   lora_program), and run the steps with adapter rows too.
"""
from __future__ import annotations

import logging

from ..backend import Backend
from ..config import EngineConfig
from ..errors import BackendCapabilityError
from .sources import load_adapter
from .context import LoraContext
from .layers import wrap_model
from .manager import LoraManager, stack_targets
from .stacks import make_stacks
from .targets import LoraTarget, find_targets  # noqa: F401 - find_targets: the loader's first step

logger = logging.getLogger(__name__)


def attach_lora(loaded, backend: Backend, config: EngineConfig,
                targets: dict[tuple[str, int], LoraTarget]) -> LoraManager:
    lora = config.lora
    kernel = backend.lora_kernel()
    if kernel is None:
        raise BackendCapabilityError(f"backend {backend.name!r} declares LoRA support but has no LoRA kernel "
                                     "(Backend.lora_kernel returned None)")
    if not targets:
        raise BackendCapabilityError("LoRA adapters: this model has no layer an adapter can target "
                                     "(q/k/v/o_proj, gate/up/down_proj)")
    names = [name for name, _ in lora.adapters]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"LoRA adapter names must be unique: {', '.join(duplicates)} given twice")
    adapters = [load_adapter(name, path, targets, lora.max_lora_rank, loaded.dtype, uid)
                for uid, (name, path) in enumerate(lora.adapters, start=1)]
    stacks = make_stacks(stack_targets(targets, adapters), lora.max_loras, lora.max_lora_rank, loaded.dtype,
                         backend.device)
    context = LoraContext(kernel)
    manager = LoraManager(lora, targets, stacks, context, loaded.dtype, adapters)
    logger.info("%s", manager.describe())
    return manager


def wrap_layers(model, manager: LoraManager) -> None:
    wrapped = wrap_model(model, manager.stacks, manager.context)
    logger.info("LoRA: %d layers wrapped", wrapped)
