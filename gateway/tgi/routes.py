"""TGI's native routes: `/generate`, `/generate_stream`, `/` (compat), `/info`,
`/invocations` (SageMaker); `/tokenize` and `/chat_tokenize` live in tokenize.py, TEI's
`/embed` in embed.py.

The life cycle is gateway/pipeline.py's: a concurrency slot first (429 past
--max-concurrent-requests, as TGI's semaphore does), validation and tokenization
off the event loop before anything reaches the engine, and the slot released
exactly once: when the answer is built, when its stream ends, or when the client
goes away (its engine requests are aborted then, so their KV blocks are freed by
the next step). This module holds TGI's parser call and its renderers.

Unlike TGI, a stream that fails before its first token (validation, overload)
answers with the HTTP error itself rather than a 200 carrying an error event;
both TGI clients handle either.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..auth import require_api_key
from ..errors import ErrorKind, GatewayError, SafeJSONResponse
from ..health import health_response
from ..models_registry import service_for, tgi_model_name
from ..openai.chat import create_chat_completion
from ..openai.completions import create_completion
from ..openai.schemas import ChatCompletionRequest, CompletionRequest
from ..pipeline import Pipeline, StreamRenderer, off_loop
from ..service import GenerationService
from ..streaming import sse_data
from ..structured import compiled
from .body import json_object, parse
from .outputs import Sequence, generate_response, stream_event, timing_headers, vocab_for
from .schemas import CompatGenerateRequest, GenerateParameters, GenerateRequest
from .embed import router as embed_router
from .tokenize import router as tokenize_router
from .images import markdown_images
from .validation import GenerationPlan, plan_generation

router = APIRouter()
router.include_router(tokenize_router)
router.include_router(embed_router)
_AUTH = [Depends(require_api_key)]


async def _service(request: Request) -> GenerationService:
    """The model the request names (X-Model header or ?model=; gateway/models_registry.py), else the default."""
    return await service_for(request, tgi_model_name(request))


def _compute_type(service: GenerationService) -> str:
    info = service.client.info  # None until the engine has started
    return info.backend if info is not None else "unknown"


async def _submit(service: GenerationService, inputs: str, parameters: GenerateParameters, stream: bool):
    """TGI's validation (in its order) and tokenization off the event loop, the grammar
    pre-check (a grammar the engine cannot compile is a 422, not a failed stream), submit; with
    `adapter_id`, through the adapter's view of the service (gateway/lora)."""
    service = service.with_adapter(parameters.adapter_id)
    inputs, images = await markdown_images(service, inputs)  # a vision model's ![](url) images
    plan = await off_loop(plan_generation, service, inputs, parameters, stream=stream)
    if plan.params[0].grammar is not None:
        await compiled(service.client, plan.params[0].grammar, "grammar")
    return plan, await service.submit_all([(plan.prompt_ids, params) for params in plan.params], images=images)


# -- /generate and / (not streamed) ---------------------------------------------------
async def generate_answer(service: GenerationService, request: Request, inputs: str,
                          parameters: GenerateParameters, compat: bool = False) -> SafeJSONResponse:
    """A whole answer: `{generated_text, details?}` (a one-item list on `/`)."""
    pipeline = Pipeline(service)
    admission, (plan, streams) = await pipeline.start(lambda: _submit(service, inputs, parameters, stream=False))
    vocab = vocab_for(service.tokenizer)
    sequences = [Sequence(vocab, params.seed) for params in plan.params]
    body = await pipeline.collect(admission, streams, request, _answer(service, streams, plan, sequences))
    best = max(range(len(sequences)), key=lambda i: sequences[i].cumulative_logprob)
    timings = service.timings(streams[best], sequences[best].last, admission.received_at)
    headers = timing_headers(timings, plan, len(sequences[best].tokens), _compute_type(service))
    return SafeJSONResponse([body] if compat else body, headers=headers)


async def _answer(service: GenerationService, streams, plan: GenerationPlan, sequences: list[Sequence]) -> dict:
    outputs = service.merged(streams)
    try:
        async for index, out in outputs:
            sequences[index].add(out)
    finally:
        await outputs.aclose()
    return generate_response(plan, sequences)


# -- /generate_stream and / with stream=true -------------------------------------------
async def stream_answer(service: GenerationService, inputs: str, parameters: GenerateParameters) -> Response:
    """Server-sent events, one per token; the last carries `generated_text` and `details`."""
    pipeline = Pipeline(service)
    admission, (plan, streams) = await pipeline.start(lambda: _submit(service, inputs, parameters, stream=True))
    headers = {"x-compute-type": _compute_type(service), "x-compute-characters": str(len(inputs))}
    return pipeline.stream(admission, streams, TokenEvents(plan, Sequence(vocab_for(service.tokenizer),
                                                                          plan.params[0].seed)), headers)


class TokenEvents(StreamRenderer):
    """TGI's stream: one `data:` event per token, the last with the text and details;
    an error (or a stream that ended unfinished) as one `{error, error_type}` event."""

    def __init__(self, plan: GenerationPlan, sequence: Sequence):
        self._plan = plan
        self._sequence = sequence
        self._index = 0

    def on_output(self, index: int, out) -> list[str]:
        sequence = self._sequence
        pairs = sequence.add(out)
        if out.finished and not pairs and sequence.tokens:  # a finish without a new token
            pairs = [(sequence.tokens[-1], sequence.top_tokens[-1])]
            self._index -= 1
        events = []
        for i, (token, top_tokens) in enumerate(pairs):
            self._index += 1
            last = out.finished and i == len(pairs) - 1
            events.append(sse_data(stream_event(self._index, token, top_tokens, self._plan,
                                                sequence if last else None), "tgi"))
        return events

    def tail(self) -> list[str]:
        if not self._sequence.finished:
            raise GatewayError(ErrorKind.INCOMPLETE, "Incomplete generation")
        return []

    def on_error(self, error: GatewayError) -> list[str]:
        return [sse_data(error.tgi_body(), "tgi")]


# -- routes -------------------------------------------------------------------------------
@router.post("/generate", dependencies=_AUTH)
async def generate(body: GenerateRequest, request: Request):
    return await generate_answer(await _service(request), request, body.inputs, body.parameters)


@router.post("/generate_stream", dependencies=_AUTH)
async def generate_stream(body: GenerateRequest, request: Request):
    return await stream_answer(await _service(request), body.inputs, body.parameters)


@router.post("/", dependencies=_AUTH)
async def compat_generate(body: CompatGenerateRequest, request: Request):
    """TGI's compat route (what `text-generation` and `InferenceClient` call):
    `stream` picks SSE, otherwise a one-item JSON list."""
    return await _compat(await _service(request), request, body)


async def _compat(service: GenerationService, request: Request, body: CompatGenerateRequest):
    if body.stream:
        return await stream_answer(service, body.inputs, body.parameters)
    return await generate_answer(service, request, body.inputs, body.parameters, compat=True)


@router.get("/", include_in_schema=False)
async def root_health(request: Request) -> Response:
    """TGI answers GET / like /health."""
    return health_response(request.app.state.service.client)


@router.post("/invocations", dependencies=_AUTH)
async def invocations(request: Request):
    """SageMaker: `inputs` -> TGI generate, `messages` -> chat completions,
    `prompt` -> completions, decided by the body."""
    body = await json_object(request)
    if "inputs" in body:
        return await _compat(await _service(request), request, parse(CompatGenerateRequest, body))
    if "messages" in body:
        return await create_chat_completion(parse(ChatCompletionRequest, body), request)
    if "prompt" in body:
        return await create_completion(parse(CompletionRequest, body), request)
    raise GatewayError(ErrorKind.VALIDATION, "the body must carry `inputs` (generate), `messages` (chat) "
                       "or `prompt` (completions)")


@router.get("/info")
async def info(request: Request) -> SafeJSONResponse:
    """TGI's Info, plus a few fields of ours."""
    service = await _service(request)
    settings = service.settings
    engine = service.client.info  # None until the engine has started
    limits = service.limits if engine is not None else None
    return SafeJSONResponse({
        "model_id": settings.model_id, "model_sha": None,
        # the Hub's tag of a model served for embeddings (core/pooling); TGI's null otherwise
        "model_pipeline_tag": "feature-extraction" if engine is not None and engine.pooling is not None else None,
        "max_concurrent_requests": settings.max_concurrent_requests, "max_best_of": settings.max_best_of,
        "max_stop_sequences": settings.max_stop_sequences,
        "max_input_tokens": limits.max_input_tokens if limits else settings.max_input_tokens,
        "max_input_length": limits.max_input_tokens if limits else settings.max_input_tokens,
        "max_total_tokens": limits.max_total_tokens if limits else settings.max_total_tokens,
        "validation_workers": 1, "max_client_batch_size": settings.max_client_batch_size,
        "router": "text-generation-router", "version": settings.version, "sha": None, "docker_label": None,
        "max_top_n_tokens": settings.max_top_n_tokens,
        "max_batch_total_tokens": engine.max_batch_total_tokens if engine else None,
        "model_device_type": engine.backend if engine else None, "server": "switchyard",
        "speculate": engine.speculate if engine else None,  # TGI's: proposed tokens verified per step
        "isa": (engine.isa or None) if engine else None,  # ours: the instruction set the kernels run at
        # ours: how the integer kernels round activations for quantized weights (int8x2 | int8)
        "quantized_activations": (engine.activations or None) if engine else None,
    })
