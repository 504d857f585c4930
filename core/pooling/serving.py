"""What an engine that serves a pooling model changes in its configuration, decided once here
from the loaded model, before its runner and scheduler are built (every shard alike); and
which requests it takes."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ..config import EngineConfig
from ..errors import BackendCapabilityError, ValidationError
from .spec import PoolingSpec

logger = logging.getLogger(__name__)


def serving_config(config: EngineConfig, loaded: Any, backend_name: str, pools: bool) -> EngineConfig:
    """`config` for the loaded model (`loaded.pooling`: how it pools, None when it generates;
    `loaded.model.causal`). An encoder (not causal) computes each prompt whole in one step
    (its tokens attend to the whole prompt), so prompts are not chunked and no decode step is
    prepared (compiled, captured) for it. A pooling model on a backend whose runner cannot
    hand back hidden states (`pools`: Capabilities.pooling) is refused."""
    if loaded.pooling is None:
        return config
    if not pools:
        raise BackendCapabilityError(f"backend {backend_name!r} cannot serve an embedding model: its runner hands "
                                     "back logits only (Capabilities.pooling)")
    if loaded.model.causal:
        return config
    if config.scheduler.max_num_batched_tokens < loaded.max_model_len:
        logger.warning("an encoder computes each prompt in one step: prompts longer than the step's %d tokens "
                       "(--max-batch-prefill-tokens) are refused, below its context of %d",
                       config.scheduler.max_num_batched_tokens, loaded.max_model_len)
    return replace(config, scheduler=replace(config.scheduler, chunk_prompts=False), compile_decode=False,
                   graph_batch_sizes=())


def check_served(request: Any, pooling: PoolingSpec | None) -> None:
    """Refuses (ValidationError) a request the engine's model is not served for: a pooling
    request to a model that generates, a generation request to one that embeds, or
    dimensions the model cannot give (PoolingSpec.check)."""
    if request.pooling is None and pooling is not None:
        raise ValidationError("this model is served for embeddings (--task embed): it does not generate text; "
                              "ask /v1/embeddings", "model")
    if request.pooling is not None and pooling is None:
        raise ValidationError("this model is not an embedding model: it is served for text generation (a model "
                              "is served for embeddings with --task embed)", "model")
    if pooling is not None:
        pooling.check(request.pooling)
