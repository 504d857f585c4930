"""What the engine does with a backend's declared Capabilities: the one place they are enforced.

Called once when an engine starts, before anything is loaded:
- an instruction-set level (`isa`) the backend does not list is refused (one line);
- `dtype="auto"` becomes the backend's preferred dtype, or float32 for weights it multiplies in
  integers (Capabilities.integer_quantizations; the copy returned says which); `vision_dtype`
  "auto" (the model's dtype) becomes, beside such integer weights, the backend's preferred dtype
  for a vision tower's float weights;
- `quantize` becomes the method the weights are served in (core/quant/choice.py served_method:
  a GGUF file in its own blocks, a Hub checkpoint in its quantization_config's method);
- shards (--num-shard > 1) where the backend declares why it cannot run them here
  (Capabilities.unshardable_reason) are refused (one line);
- a `quantize` the backend does not declare is refused (one line), and so is any `quantize`
  with tensor parallelism (quantized weights are loaded whole, core/layers/linear.py);
- a dtype, KV block size or KV cache dtype (--kv-cache-dtype other than auto) outside the declared
  lists is refused (BackendCapabilityError, one line naming the backend, the value asked and the
  values it supports): running it anyway would fail later inside a kernel, or silently compute
  something else;
- LoRA adapters (--lora-adapters, --enable-lora) on a backend without Capabilities.lora, or
  with shards, are refused (one line);
- prefix caching or mixed prefill/decode steps, asked of a backend that declares it cannot do
  them, are turned off with one logged line (as vLLM does for prefix caching): both are
  optimisations, and the engine serves the same tokens without them;
- so is speculative decoding (--speculate), asked of a backend that does not declare
  multi-token decode queries (Capabilities.multi_token_decode).
"""
from __future__ import annotations

import logging
from dataclasses import replace

from .backend_contract import Capabilities
from .config import EngineConfig
from .errors import BackendCapabilityError
from .quant.methods import NONE

logger = logging.getLogger(__name__)

# The dtype names a Capabilities.dtypes may hold (ModelConfig.dtype takes the same names).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _listed(values) -> str:
    return ", ".join(str(v) for v in values) or "(none)"


def _served_quantization(config: EngineConfig, caps: Capabilities) -> str | None:
    """The method the weights are served in (core/quant/choice.py served_method), logged once."""
    from .loader import served_quantization

    quantize, why = served_quantization(config.model, config.parallel.tensor_parallel_size > 1, caps.quantizations)
    if quantize is not None or config.model.quantize is not None:
        logger.info("weights: %s (%s)", "floats" if quantize in (None, NONE) else quantize, why)
    return quantize


def _check_quantization(backend: str, caps: Capabilities, quantize: str | None) -> None:
    if quantize not in (None, NONE) and quantize not in caps.quantizations:
        raise BackendCapabilityError(f"backend {backend!r} does not support --quantize {quantize}; "
                                     f"it supports: {_listed(caps.quantizations)}")


def _check_lora(backend: str, caps: Capabilities, config: EngineConfig) -> None:
    """LoRA adapters (core/lora) need the backend's batched low-rank kernel, and one shard."""
    if not config.lora.enabled:
        return
    if not caps.lora:
        raise BackendCapabilityError(f"backend {backend!r} does not serve LoRA adapters "
                                     "(--lora-adapters / --enable-lora)")
    shards = config.parallel.tensor_parallel_size
    if shards > 1:
        raise BackendCapabilityError(f"LoRA adapters cannot be combined with --num-shard {shards}: "
                                     "adapters are not split over shards")


def check_capabilities(backend: str, caps: Capabilities, config: EngineConfig) -> EngineConfig:
    """The configuration this backend will run: `config` itself, or a copy with what the
    backend cannot do turned off. Raises BackendCapabilityError for what it cannot serve."""
    levels = dict(caps.isa_levels)
    if config.isa != "auto" and config.isa not in levels:
        raise BackendCapabilityError(f"backend {backend!r} cannot run at instruction-set level {config.isa!r} here; "
                                     f"it can: {_listed(('auto', *levels))}")
    shards = config.parallel.tensor_parallel_size
    if shards > 1 and caps.unshardable_reason:
        raise BackendCapabilityError(f"backend {backend!r} cannot run --num-shard {shards} here: "
                                     f"{caps.unshardable_reason}")
    _check_lora(backend, caps, config)
    _check_quantization(backend, caps, config.model.quantize)  # as asked, then as served
    quantize = _served_quantization(config, caps)
    _check_quantization(backend, caps, quantize)
    if quantize != config.model.quantize:
        config = replace(config, model=replace(config.model, quantize=quantize))
    if quantize not in (None, NONE) and config.parallel.tensor_parallel_size > 1:
        raise BackendCapabilityError(f"--quantize {quantize} cannot be combined with --num-shard "
                                     f"{config.parallel.tensor_parallel_size}: quantized weights are not split over shards")
    dtype, vision_dtype = config.model.dtype, config.model.vision_dtype
    if dtype == "auto":
        preferred = levels.get(config.isa, caps.preferred_dtype)
        if quantize in caps.integer_quantizations and "float32" in caps.dtypes:
            dtype, why = "float32", f"{quantize} weights are multiplied in integers"
            if vision_dtype == "auto":  # a vision tower's weights are floats: the backend's float choice
                vision_dtype = preferred
        else:
            dtype, why = preferred, "the backend prefers it"
        logger.info("dtype %s: %s (backend %r)", dtype, why, backend)
    if (dtype, vision_dtype) != (config.model.dtype, config.model.vision_dtype):
        config = replace(config, model=replace(config.model, dtype=dtype, vision_dtype=vision_dtype))
    for name in {dtype, vision_dtype} - {"auto"}:
        if name not in caps.dtypes:
            raise BackendCapabilityError(f"backend {backend!r} does not support dtype {name!r}; "
                                         f"it supports: {_listed(caps.dtypes)}")
    block_size = config.cache.block_size
    if block_size not in caps.block_sizes:
        raise BackendCapabilityError(f"backend {backend!r} does not support KV block size {block_size}; "
                                     f"it supports: {_listed(caps.block_sizes)}")
    kv_cache_dtype = config.cache.kv_cache_dtype
    if kv_cache_dtype != "auto" and kv_cache_dtype not in caps.kv_cache_dtypes:
        raise BackendCapabilityError(f"backend {backend!r} does not support --kv-cache-dtype {kv_cache_dtype}; "
                                     f"it supports: {_listed(('auto', *caps.kv_cache_dtypes))}")
    if config.cache.enable_prefix_caching and not caps.prefix_caching:
        logger.info("prefix caching off: backend %r does not support it", backend)
        config = replace(config, cache=replace(config.cache, enable_prefix_caching=False))
    if config.cache.partial_prefix_hits and not caps.partial_prefix_hits:
        config = replace(config, cache=replace(config.cache, partial_prefix_hits=False))
    if config.scheduler.mixed_prefill_decode and not caps.mixed_prefill_decode:
        logger.info("steps are prefill-only or decode-only: backend %r cannot mix them", backend)
        config = replace(config, scheduler=replace(config.scheduler, mixed_prefill_decode=False))
    if config.speculative.enabled and not caps.multi_token_decode:
        logger.info("speculative decoding off: backend %r cannot verify several tokens of a decode in one step",
                    backend)
        config = replace(config, speculative=replace(config.speculative, num_speculative_tokens=0))
    return config
