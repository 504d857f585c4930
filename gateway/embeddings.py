"""Embeddings, written once for the dialects that serve them (OpenAI's `/v1/embeddings`,
gateway/openai/embeddings.py; TEI's `/embed`, gateway/tgi/embed.py).

A dialect parses its body into inputs and `PoolingParams`; here they are checked against the
model (an embedding model at all, the dimensions it can give: PoolingSpec.check), tokenized
off the event loop (texts, or token ids as given), checked against the context, submitted as
pooling requests in one engine command and collected, through the same pipeline as generation
(a concurrency slot; a client that goes away aborts them). The dialect writes the vectors."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from switchyard.core.params import ValidationError
from switchyard.core.pooling.params import PoolingParams
from switchyard.core.pooling.spec import PoolingSpec
from switchyard.core.scheduling.request import RequestOutput

from .errors import invalid
from .pipeline import Pipeline, off_loop
from .service import GenerationService

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit for /v1/embeddings)


@dataclass(frozen=True)
class EmbeddingInputs:
    """What a dialect asks: each input a text or token ids, and how long an input may be made."""

    items: list[str | list[int]]
    param: str  # the body's field, named in errors ("input", "inputs")
    add_special_tokens: bool = True
    # an input longer than the context: None refuses it; "start" keeps its first tokens (TEI's
    # right truncation), "end" its last (vLLM's truncate_prompt_tokens) ...
    truncate: str | None = None
    truncate_to: int | None = None  # ... down to this many (None: the context)


def embedding_spec(service: GenerationService) -> PoolingSpec:
    """How the served model pools; a 400 when it is not served for embeddings."""
    service.require_ready()
    spec = service.client.info.pooling
    if spec is None:
        raise invalid(f"model `{service.settings.model_id}` is not an embedding model: it is served for text "
                      "generation (a model is served for embeddings with `switchyard serve --task embed`)", "model")
    return spec


def checked_params(spec: PoolingSpec, params: PoolingParams) -> PoolingParams:
    """`params` if the model can give them (dimensions), else a 400 naming the field."""
    try:
        spec.check(params)
    except ValidationError as exc:
        raise invalid(str(exc), exc.param) from exc
    return params


def max_input_tokens(service: GenerationService) -> int:
    """The longest input: the model's context (a pooling request generates nothing), or less
    with --max-input-tokens."""
    context = service.client.info.max_model_len
    return min(context, service.settings.max_input_tokens or context)


def tokenized(service: GenerationService, inputs: EmbeddingInputs) -> list[list[int]]:
    """Each input's token ids (run it off the event loop): refused when there are none, too
    many, one is empty, holds an id outside the vocabulary, or is too long and not truncated."""
    items = inputs.items
    if not items:
        raise invalid(f"{inputs.param} must not be empty", inputs.param)
    if len(items) > MAX_INPUTS:
        raise invalid(f"at most {MAX_INPUTS} inputs per request. Given: {len(items)}", inputs.param)
    limit = max_input_tokens(service)
    keep = min(limit, inputs.truncate_to or limit)
    vocab_size = len(service.tokenizer)
    prompts = []
    for i, item in enumerate(items):
        param = inputs.param if len(items) == 1 else f"{inputs.param}.{i}"
        if isinstance(item, str):
            ids = service.encode(item, inputs.add_special_tokens)
        else:
            ids = _known_ids(item, vocab_size, param)
        if not ids:
            raise invalid(f"{param} must not be empty", param)
        if inputs.truncate is not None and len(ids) > keep:
            ids = ids[:keep] if inputs.truncate == "start" else ids[-keep:]
        if len(ids) > limit:
            raise invalid(f"{param} has {len(ids)} tokens, more than this model's limit of {limit} tokens; shorten "
                          "it or ask for truncation", param)
        prompts.append(ids)
    return prompts


def _known_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise invalid(f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})", param)
    return list(ids)


async def embed(service: GenerationService, http_request: Request, inputs: EmbeddingInputs,
                params: PoolingParams) -> list[RequestOutput]:
    """The embeddings of `inputs`, one finished output each (`.embedding`, `.num_prompt_tokens`), in order."""
    pipeline = Pipeline(service, embeddings=True)

    async def prepare():
        checked = checked_params(embedding_spec(service), params)
        prompts = await off_loop(tokenized, service, inputs)
        return await service.submit_pooling(prompts, checked)

    admission, streams = await pipeline.start(prepare)
    return await pipeline.collect(admission, streams, http_request, service.collect_pooled(streams))
