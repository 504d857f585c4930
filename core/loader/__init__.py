"""Model loading: one entry point, `load_model`, for every weight source
(Hugging Face directory or cache name, GGUF file, the default model, dummy).

It reads as a straight pipeline, each stage deciding once and handing its result down:
1. `plan_load`: resolve the source (source.py), read the config, decide how the model is served
   (generation or embeddings, core/pooling/decide.py), choose the code that runs the model
   (models/__init__.py) and the quantization method its weights are served in
   (quant/choice.py) - a `LoadPlan`, with no weight read;
2. build the model on the backend's device, weights not loaded (`_build_model`);
3. `open_weights`: one reader for the plan's format - the GGUF file's blocks packed
   (gguf_packed.py) or dequantized (gguf_weights.py), a quantized Hub checkpoint's reader
   (quant/hub), plain safetensors - and the model's `load_weights` takes what it yields; a GGUF
   with an mmproj file (mmproj.py) is its language model's reader, then the vision tower's;
4. quantize at load where the method asks it (quant/apply.py), and fit the context.
The backend's `prepare_model` (called by the engine after this) then packs for its kernels.

With a sharded ShardInfo it builds this shard's slice of a tensor-parallel model
(core/layers/parallel.py) whose collectives go through the given Communicator, and reads
only this shard's slices of the safetensors files."""
from __future__ import annotations

import itertools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Iterable

import torch
from torch import nn

from ..backend_contract import (SINGLE_SHARD, AttentionKernel, AttentionSpec, BackendInterface, Communicator,
                                ShardInfo)
from ..text.chat_template import apply_chat_template
from ..config import ModelConfig
from ..layers.parallel import TensorParallel
from ..quant.apply import QUANTIZE_AT_LOAD, QuantizeError, quantize_model
from ..quant.choice import served_method
from ..quant.methods import detect
from ..quant.hub import weights_reader
from .gguf_packed import GGUFPackedWeights
from ..models.base import CausalLM
from ..models.plain_config import read_plain_config
from ..text.serving_tokenizer import ServingTokenizer
from ..models import ModelChoice, UnsupportedModelError, check_shardable, is_encoder, select_model, supported_summary
from ..pooling.decide import decide_pooling
from ..pooling.spec import PoolingSpec
from .dummy import fill_dummy_weights
from .gguf_weights import GGUFWeights, load_gguf_config, load_gguf_tokenizer
from .mmproj import MmprojWeights, read_mmproj, vision_language_config
from .named_configs import NAMED_CONFIGS, dummy_tokenizer, named_config
from .safetensors_weights import (count_safetensors_weights, generation_eos_token_ids, iterate_safetensors,
                                  load_hf_config, safetensors_files)
from .source import ModelNotFoundError, ModelSource, default_model_path, gguf_refusals, resolve_source

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM  # eval mode, on backend.device, in `dtype` (models/base.py declares the calls)
    hf_config: Any  # transformers PretrainedConfig, or a PlainConfig (models/plain_config.py)
    attention_spec: AttentionSpec  # KV cache shape and dtype (layer 0's spec)
    attention_specs: tuple[AttentionSpec, ...]  # per layer (sliding windows may differ)
    num_layers: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    vocab_size: int
    dtype: torch.dtype
    source: ModelSource
    model_impl: str = "native"  # "native" | "transformers": which path runs it (models/__init__.py)
    pooling: PoolingSpec | None = None  # served for embeddings: how it pools (core/pooling); None: generation


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def checkpoint_quantization(hf_config: Any) -> Any:
    """The checkpoint's quantization_config (core/quant/methods.py detects its method), None for
    a float checkpoint or no config. Read with getattr: transformers' PretrainedConfig, not a
    contract of ours, has the attribute only when the checkpoint's config.json names one (as
    eos_token_id and max_position_embeddings, read below, exist only for some model types)."""
    return getattr(hf_config, "quantization_config", None)


def load_config(source: ModelSource, trust_remote_code: bool = False) -> Any:
    """The model's config: transformers' class, or for a GGUF's converted metadata the plain
    attributes kept there (models/plain_config.py: no transformers import); with an mmproj file,
    the vision-language model's around the GGUF's (mmproj.py)."""
    if source.mmproj is not None:
        text_config = _model_config(replace(source, mmproj=None), trust_remote_code)
        return vision_language_config(text_config, read_mmproj(source.mmproj),
                                      lambda: _gguf_tokenizer(source, text_config),
                                      os.path.basename(source.path))
    return _model_config(source, trust_remote_code)


def _gguf_tokenizer(source: ModelSource, config: Any) -> Any:
    """The GGUF's tokenizer: the ServingTokenizer its converted metadata keeps, else transformers'."""
    if source.metadata is not None and (tokenizer := ServingTokenizer.read(source.metadata)) is not None:
        return tokenizer
    directory, gguf_file = source.tokenizer_files
    if gguf_file is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    return load_gguf_tokenizer(directory, gguf_file, config)


def _model_config(source: ModelSource, trust_remote_code: bool) -> Any:
    if source.kind == "named":
        return named_config(source.path)
    if source.kind == "gguf" and source.metadata is None:
        with gguf_refusals(source.path):
            return load_gguf_config(source.path)
    if source.kind == "gguf" and (plain := read_plain_config(source.metadata)) is not None:
        return plain
    return load_hf_config(source.metadata or source.path, trust_remote_code)


def choose_model(model_config: ModelConfig) -> tuple[ModelSource, Any, ModelChoice]:
    """Where the model comes from, its config, how it is served (`--task`: its choice's
    `pooling`) and which path runs it; an architecture no path runs raises
    UnsupportedModelError. Cheap: no weights are read."""
    source = resolve_source(model_config)
    hf_config = load_config(source, model_config.trust_remote_code)
    pooling = decide_pooling(model_config.task, model_config.pooling, hf_config, is_encoder(hf_config),
                             directory=source.path if source.kind == "safetensors" else None,
                             gguf_file=source.gguf_file)
    return source, hf_config, select_model(hf_config, model_config.model_impl, model_config.trust_remote_code,
                                           pooling)


def served_quantization(model_config: ModelConfig, sharded: bool = False,
                        backend_methods: tuple[str, ...] = ("gguf",)) -> tuple[str | None, str]:
    """(the method the weights are served in, why): methods.served_method over this model's
    source (a GGUF file, a checkpoint's quantization_config), --quantize and the methods the
    backend serves. Cheap: a GGUF file's config is not read (its blocks decide)."""
    source = resolve_source(model_config)
    gguf_file = _gguf_file(source)
    config = None if gguf_file is not None or source.kind == "named" else \
        load_config(source, model_config.trust_remote_code)
    return served_method(model_config.quantize, gguf_file, checkpoint_quantization(config), sharded, backend_methods)


def _gguf_file(source: ModelSource) -> str | None:
    """The GGUF file whose blocks the weights come from (None: not a GGUF, or dummy weights)."""
    return source.gguf_file if source.load_format != "dummy" else None


@dataclass(frozen=True)
class LoadPlan:
    """What loading decides before it reads a weight, each once, in this order."""

    source: ModelSource  # where the weights come from
    hf_config: Any  # the model's config (transformers' PretrainedConfig or a PlainConfig)
    choice: ModelChoice  # the code that runs it (the build may hand it to the fallback)
    quantize: str | None  # the method its weights are served in (quant/methods.py)
    dtype: torch.dtype


def plan_load(model_config: ModelConfig, backend_methods: tuple[str, ...] = ("gguf",),
              shard: ShardInfo = SINGLE_SHARD) -> LoadPlan:
    """The source, the config, the model's code and the served quantization; refuses (one
    line) a model no path runs, a shard count its heads do not divide, or a method the
    backend does not serve. Reads no weight."""
    source, hf_config, choice = choose_model(model_config)
    quantize, _ = served_method(model_config.quantize, _gguf_file(source), checkpoint_quantization(hf_config),
                                shard.sharded, backend_methods)
    check_shardable(hf_config, shard.world_size)
    return LoadPlan(source, hf_config, choice, quantize, torch_dtype(model_config.dtype))


def load_model(model_config: ModelConfig, backend: BackendInterface, block_size: int, shard: ShardInfo = SINGLE_SHARD,
               communicator: Communicator | None = None, kv_cache_dtype: str = "auto") -> LoadedModel:
    """The model on the backend's device, weights loaded, eval mode. shard.sharded: this
    shard's slice (its heads, MLP and vocabulary slices; attention_spec with its head
    counts), collectives through `communicator`; the logits stay [N, vocab] on every shard.
    kv_cache_dtype (CacheConfig.kv_cache_dtype): what every layer's spec, and so its kernel and
    its cache, stores."""
    plan = plan_load(model_config, backend.capabilities().quantizations, shard)
    tp = TensorParallel(shard.rank, shard.world_size, communicator) if shard.sharded else TensorParallel()
    make_kernel = _kernel_factory(backend, kv_cache_dtype)
    model, choice = _build_model(plan.choice, plan.hf_config, model_config.model_impl, make_kernel, backend.device,
                                 block_size, plan.dtype, tp)
    logger.info("model %s%s", choice.describe(), f", shard {shard.rank} of {shard.world_size}" if tp.sharded else "")
    if plan.source.load_format == "dummy":
        fill_dummy_weights(model, model_config.seed, per_name=tp.sharded)
    else:
        _read_weights(model, *open_weights(plan, lazy=tp.sharded), plan.source.path)
    prequantized = detect(checkpoint_quantization(plan.hf_config)) is not None  # its own layers only
    if plan.quantize in QUANTIZE_AT_LOAD and not prequantized and \
            quantize_model(model, plan.quantize, head=model.output_head()) == 0:
        raise QuantizeError(f"--quantize {plan.quantize}: model {choice.describe()} has no linear this engine "
                            "quantizes")
    vision_dtype = torch_dtype(model_config.vision_dtype) if model_config.vision_dtype != "auto" else plan.dtype
    if model.vision_modules():
        logger.info("vision tower in %s", str(vision_dtype).removeprefix("torch."))
    for module in model.vision_modules():
        module.to(vision_dtype)
    model.eval()
    specs = tuple(replace(spec, kv_cache_dtype=kv_cache_dtype) for spec in model.attention_specs)
    max_model_len = _max_model_len(model_config, plan.hf_config, type(model))
    model.fit_context(max_model_len)  # e.g. longrope picks its factors for the served context
    return LoadedModel(model=model, hf_config=plan.hf_config, attention_spec=specs[0], attention_specs=specs,
                       num_layers=len(specs), eos_token_ids=_eos_token_ids(plan.source, plan.hf_config),
                       max_model_len=max_model_len, vocab_size=_vocab_size(plan.hf_config), dtype=plan.dtype,
                       source=plan.source, model_impl=choice.impl, pooling=choice.pooling)


def _kernel_factory(backend: BackendInterface, kv_cache_dtype: str) -> Callable[[AttentionSpec], AttentionKernel]:
    """backend.attention for the specs a model declares, each told what the KV cache stores (the
    models build their specs from their config alone)."""
    if kv_cache_dtype == "auto":
        return backend.attention
    return lambda spec: backend.attention(replace(spec, kv_cache_dtype=kv_cache_dtype))


def _build_model(choice: ModelChoice, hf_config: Any, model_impl: str,
                 make_kernel: Callable[[AttentionSpec], AttentionKernel], device: torch.device, block_size: int,
                 dtype: torch.dtype, tp: TensorParallel) -> tuple[CausalLM, ModelChoice]:
    """The model on the backend's device, weights not loaded. Native code that meets a
    config feature it does not implement (e.g. a rope_scaling variant) hands the model to
    the transformers fallback under model_impl="auto", and is refused under "native"."""
    with torch.device(device):
        try:
            return choice.model_class(hf_config, make_kernel, block_size, dtype, tp), choice
        except NotImplementedError as error:
            if choice.impl != "native":
                raise
            if model_impl == "native" or choice.pooling is not None:  # embeddings: native code only
                raise UnsupportedModelError(f"model {choice.architecture} ({choice.model_type}): the native code "
                                            f"does not implement this config: {error}") from None
            logger.info("model %s: native code does not implement this config (%s); using the transformers "
                        "fallback", choice.architecture, error)
            fallback = select_model(hf_config, "transformers")
            return fallback.model_class(hf_config, make_kernel, block_size, dtype, tp), fallback


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The tokenizer that goes with `load_model(model_config, ...)`, with
    `model_config.chat_template` installed when given: the ServingTokenizer a GGUF's converted
    metadata keeps (no transformers import), else transformers' (`load_hf_tokenizer`)."""
    source = resolve_source(model_config)
    if source.kind == "gguf" and source.metadata is not None and \
            (tokenizer := ServingTokenizer.read(source.metadata)) is not None:
        apply_chat_template(tokenizer, model_config.chat_template)
        return tokenizer
    return load_hf_tokenizer(model_config)


def load_hf_tokenizer(model_config: ModelConfig) -> Any:
    """transformers' tokenizer for the model (what grammar compilers take), with
    `model_config.chat_template` installed when given."""
    tokenizer = _load_tokenizer(model_config)
    apply_chat_template(tokenizer, model_config.chat_template)
    return tokenizer


def _load_tokenizer(model_config: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    source = resolve_source(model_config)
    if source.kind == "named":
        config = named_config(source.path)
        return dummy_tokenizer(config.vocab_size, config.bos_token_id, _first(config.eos_token_id))
    if source.kind == "gguf":
        directory, gguf_file = source.tokenizer_files
        return AutoTokenizer.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))
    return AutoTokenizer.from_pretrained(source.directory, trust_remote_code=model_config.trust_remote_code)


def open_weights(plan: LoadPlan, lazy: bool = False) -> tuple[Iterable, int]:
    """(the weights, how many): one reader for the plan's format - the GGUF file's blocks packed
    (`gguf` served, gguf_packed.py) or dequantized per tensor (gguf_weights.py), a quantized Hub
    checkpoint's reader (core/quant/hub), or plain safetensors (lazy: each shard reads only its
    slices). Each yields (Hugging Face name, tensor or QuantizedWeight)."""
    source, hf_config = plan.source, plan.hf_config
    if source.mmproj is not None:  # the language model's GGUF, then the vision tower's file (mmproj.py)
        text, count = open_weights(replace(plan, source=replace(source, mmproj=None), hf_config=hf_config.text_config))
        vision = MmprojWeights(source.mmproj, hf_config)
        return itertools.chain(text, vision), count + len(vision)
    if plan.quantize == "gguf":
        weights = GGUFPackedWeights(source.gguf_file, hf_config, source.metadata)
        return weights, len(weights)
    if source.kind == "gguf":
        weights = GGUFWeights(source.path, hf_config, source.metadata)
        return weights, len(weights)
    if (reader := weights_reader(checkpoint_quantization(hf_config))) is not None:
        weights = reader(safetensors_files(source.path), hf_config.quantization_config)
        return weights, len(weights)
    files = safetensors_files(source.path)
    return iterate_safetensors(files, lazy), count_safetensors_weights(files)


def _read_weights(model: nn.Module, weights: Iterable, total: int, path: str) -> None:
    with torch.no_grad():
        loaded = model.load_weights(_progress(weights, total))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"{path!r} lacks {len(missing)} weights of the model, e.g. {missing[:5]}")


def _progress(weights: Iterable, total: int) -> Iterable:
    if not sys.stderr.isatty():
        return weights
    from tqdm.auto import tqdm

    return tqdm(weights, total=total, desc="Loading weights", unit="tensor")


def _vocab_size(hf_config: Any) -> int:
    """The output vocabulary: a vision-language model's is its text model's."""
    vocab_size = getattr(hf_config, "vocab_size", None)
    return vocab_size if vocab_size is not None else hf_config.text_config.vocab_size


def _first(ids: int | list[int] | None) -> int | None:
    return ids[0] if isinstance(ids, (list, tuple)) else ids


def _eos_token_ids(source: ModelSource, hf_config: Any) -> tuple[int, ...]:
    eos = generation_eos_token_ids(source.directory) if source.kind not in ("gguf", "named") else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


def _max_model_len(model_config: ModelConfig, hf_config: Any, model_class: type[CausalLM]) -> int:
    limit = model_class.context_limit(hf_config)
    wanted = model_config.max_model_len
    if wanted is not None and limit is not None and wanted > limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's context length {limit}")
    if wanted is None and limit is None:
        raise ValueError("the model config has no max_position_embeddings; set max_model_len")
    return wanted if wanted is not None else limit


def model_path_report(model: str | None, model_impl: str = "auto", trust_remote_code: bool = False,
                      load_format: str = "auto") -> str:
    """`switchyard models`: the supported architectures and, for a named model, its path."""
    lines = [f"supported: {supported_summary()}"]
    if model is not None:
        config = ModelConfig(model=model, model_impl=model_impl, trust_remote_code=trust_remote_code,
                             load_format=load_format)
        lines.append(f"{model}: {choose_model(config)[2].describe()}")
    return "\n".join(lines)


__all__ = ["DTYPES", "NAMED_CONFIGS", "LoadPlan", "LoadedModel", "ModelChoice", "ModelNotFoundError", "ModelSource",
           "UnsupportedModelError", "choose_model", "default_model_path", "load_config", "load_hf_tokenizer",
           "load_model", "load_tokenizer", "model_path_report", "named_config", "open_weights", "plan_load",
           "resolve_source", "torch_dtype"]
