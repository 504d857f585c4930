"""TGI's native routes: `/generate`, `/generate_stream`, `/` (compat), `/info`,
`/invocations` (SageMaker); `/tokenize` and `/chat_tokenize` live in tokenize.py.

Each request takes a concurrency slot first (429 past --max-concurrent-requests,
as TGI's semaphore does), is validated and tokenized before it reaches the
engine, and releases its slot exactly once: when the answer is built, when its
stream ends, or when the client goes away (the stream's engine requests are
aborted then, so their KV blocks are freed by the next step).

Unlike TGI, a stream that fails before its first token (validation, overload)
answers with the HTTP error itself rather than a 200 carrying an error event;
both TGI clients handle either.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..app import health_response, require_api_key
from ..errors import ErrorKind, GatewayError, SafeJSONResponse
from ..openai.chat import create_chat_completion
from ..openai.completions import create_completion
from ..openai.schemas import ChatCompletionRequest, CompletionRequest
from ..service import Admission, GenerationService, until_disconnected
from ..streaming import sse_data, sse_response
from ..structured import compiled
from .body import json_object, parse
from .outputs import Sequence, generate_response, stream_event, timing_headers, vocab_for
from .schemas import CompatGenerateRequest, GenerateParameters, GenerateRequest
from .tokenize import router as tokenize_router
from .validation import GenerationPlan, plan_generation

logger = logging.getLogger("switchyard.gateway.tgi")

router = APIRouter()
router.include_router(tokenize_router)
_AUTH = [Depends(require_api_key)]


def _service(request: Request) -> GenerationService:
    return request.app.state.service


def _compute_type(service: GenerationService) -> str:
    info = getattr(service.client, "info", None)
    return getattr(info, "backend", None) or "unknown"


def _dropped() -> GatewayError:
    return GatewayError(ErrorKind.INCOMPLETE, "the client went away before the answer was complete")


async def _start(service: GenerationService, admission: Admission, plan: GenerationPlan):
    if plan.params[0].grammar is not None:  # a grammar the engine cannot compile is a 422, not a failed stream
        await compiled(service.client, plan.params[0].grammar, "grammar")
    streams = await service.submit_all([(plan.prompt_ids, params) for params in plan.params])
    service.metrics.request_validation_duration.observe(
        max(0.0, streams[0].arrival_time - admission.received_at))
    return streams


# -- /generate and / (not streamed) ---------------------------------------------------
async def generate_answer(service: GenerationService, request: Request, inputs: str,
                          parameters: GenerateParameters, compat: bool = False) -> SafeJSONResponse:
    """A whole answer: `{generated_text, details?}` (a one-item list on `/`)."""
    admission = service.admit()
    try:
        plan = plan_generation(service, inputs, parameters, stream=False)
        streams = await _start(service, admission, plan)
        vocab = vocab_for(service.tokenizer)
        sequences = [Sequence(vocab, params.seed) for params in plan.params]
        await _unless_disconnected(_collect(service, streams, sequences), request, streams)
        body = generate_response(plan, sequences)
    except BaseException as exc:
        admission.release(_dropped() if isinstance(exc, asyncio.CancelledError) else exc)
        raise
    admission.release()
    best = max(range(len(sequences)), key=lambda i: sequences[i].cumulative_logprob)
    timings = service.timings(streams[best], sequences[best].last, admission.received_at)
    headers = timing_headers(timings, plan, len(sequences[best].tokens), _compute_type(service))
    return SafeJSONResponse([body] if compat else body, headers=headers)


async def _collect(service: GenerationService, streams, sequences: list[Sequence]) -> None:
    outputs = service.merged(streams)
    try:
        async for index, out in outputs:
            sequences[index].add(out)
    finally:
        await outputs.aclose()


async def _unless_disconnected(work, request: Request, streams) -> None:
    """Await `work`; if the client goes away first, abort the streams (freeing their
    KV blocks) and fail as an incomplete generation."""
    return await until_disconnected(work, request, streams, _dropped())


# -- /generate_stream and / with stream=true -------------------------------------------
async def stream_answer(service: GenerationService, inputs: str, parameters: GenerateParameters) -> Response:
    """Server-sent events, one per token; the last carries `generated_text` and `details`."""
    admission = service.admit()
    try:
        plan = plan_generation(service, inputs, parameters, stream=True)
        streams = await _start(service, admission, plan)
    except BaseException as exc:
        admission.release(exc)
        raise

    def close() -> None:  # however the response ends, even before the first event
        for stream in streams:
            stream.abort()
        admission.release(_dropped())

    headers = {"x-compute-type": _compute_type(service), "x-compute-characters": str(len(inputs))}
    return sse_response(_events(service, plan, streams, admission), headers, close)


async def _events(service: GenerationService, plan: GenerationPlan, streams, admission: Admission):
    sequence = Sequence(vocab_for(service.tokenizer), plan.params[0].seed)
    outputs = service.merged(streams)
    error: BaseException | None = None
    index = 0
    try:
        async for _, out in outputs:
            pairs = sequence.add(out)
            if out.finished and not pairs and sequence.tokens:  # a finish without a new token
                pairs = [(sequence.tokens[-1], sequence.top_tokens[-1])]
                index -= 1
            for i, (token, top_tokens) in enumerate(pairs):
                index += 1
                last = out.finished and i == len(pairs) - 1
                yield sse_data(stream_event(index, token, top_tokens, plan, sequence if last else None), "tgi")
        if not sequence.finished:
            raise GatewayError(ErrorKind.INCOMPLETE, "Incomplete generation")
    except GatewayError as exc:
        error = exc
        yield sse_data(exc.tgi_body(), "tgi")
    except Exception as exc:  # noqa: BLE001 - reported in the stream, which has already started
        logger.exception("stream failed")
        error = exc
        yield sse_data(GatewayError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}").tgi_body(), "tgi")
    except BaseException:  # the client went away: the response closes this generator
        error = _dropped()
        raise
    finally:  # synchronous first: under a cancelled scope the await below may not complete
        for stream in streams:
            stream.abort()
        admission.release(error)
        await outputs.aclose()


# -- routes -------------------------------------------------------------------------------
@router.post("/generate", dependencies=_AUTH)
async def generate(body: GenerateRequest, request: Request):
    return await generate_answer(_service(request), request, body.inputs, body.parameters)


@router.post("/generate_stream", dependencies=_AUTH)
async def generate_stream(body: GenerateRequest, request: Request):
    return await stream_answer(_service(request), body.inputs, body.parameters)


@router.post("/", dependencies=_AUTH)
async def compat_generate(body: CompatGenerateRequest, request: Request):
    """TGI's compat route (what `text-generation` and `InferenceClient` call):
    `stream` picks SSE, otherwise a one-item JSON list."""
    return await _compat(_service(request), request, body)


async def _compat(service: GenerationService, request: Request, body: CompatGenerateRequest):
    if body.stream:
        return await stream_answer(service, body.inputs, body.parameters)
    return await generate_answer(service, request, body.inputs, body.parameters, compat=True)


@router.get("/", include_in_schema=False)
async def root_health(request: Request) -> Response:
    """TGI answers GET / like /health."""
    return health_response(_service(request).client)


@router.post("/invocations", dependencies=_AUTH)
async def invocations(request: Request):
    """SageMaker: `inputs` -> TGI generate, `messages` -> chat completions,
    `prompt` -> completions, decided by the body."""
    body = await json_object(request)
    service = _service(request)
    if "inputs" in body:
        return await _compat(service, request, parse(CompatGenerateRequest, body))
    if "messages" in body:
        return await create_chat_completion(parse(ChatCompletionRequest, body), request)
    if "prompt" in body:
        return await create_completion(parse(CompletionRequest, body), request)
    raise GatewayError(ErrorKind.VALIDATION, "the body must carry `inputs` (generate), `messages` (chat) "
                       "or `prompt` (completions)")


@router.get("/info")
async def info(request: Request) -> SafeJSONResponse:
    """TGI's Info, plus a few fields of ours."""
    service = _service(request)
    settings = service.settings
    engine = getattr(service.client, "info", None)
    limits = service.limits if engine is not None else None
    return SafeJSONResponse({
        "model_id": settings.model_id, "model_sha": None, "model_pipeline_tag": None,
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
    })
