"""`fmaas.GenerationService` over the gateway's request pipeline.

Each RPC lives as an HTTP request does (gateway/pipeline.py): the API key first
(`authorization: Bearer` metadata), then a --max-concurrent-requests slot (429 ->
RESOURCE_EXHAUSTED), TGIS's parameters checked and the prompts tokenized off the event
loop (params.py), a grammar compiled by the engine before anything is queued, submit,
then the answer or the stream; the slot is released exactly once with the outcome
(metrics). A client that cancels the RPC or goes away cancels its handler, which aborts
its engine requests (their KV blocks are free by the next step). Once the server drains
(SIGTERM), new RPCs get UNAVAILABLE and RPCs still open at the drain deadline end with
UNAVAILABLE, as HTTP streams end with an error event then.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from ..auth import bearer_matches
from ..drain import SHUTDOWN_MESSAGE, UNANSWERED_MESSAGE, Drain
from ..errors import ErrorKind, GatewayError
from ..pipeline import Pipeline, off_loop
from ..service import Admission, GenerationService
from ..structured import compiled
from ..tgi.tokenize import simple_tokens
from .params import (GrpcPlan, RequestParams, adapter_service, check_batch, plan_prompt,
                     request_params)
from .proto import generation_pb2 as pb
from .proto import generation_pb2_grpc as pb_grpc
from .render import ResponseBuilder
from .status import as_gateway_error, details, status_code

logger = logging.getLogger("switchyard.gateway.grpc")

SHUTTING_DOWN = "the server is shutting down"


class _TimeLimit(Exception):
    """time_limit_millis ran out: the request ends with stop reason TIME_LIMIT."""


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, service: GenerationService, drain: Drain):
        self.service = service
        self.drain = drain

    # -- the four RPCs -------------------------------------------------------------------
    async def Generate(self, request: pb.BatchedGenerationRequest, context) -> pb.BatchedGenerationResponse:
        return await self._serve(context, lambda: self._generate(request), UNANSWERED_MESSAGE)

    async def GenerateStream(self, request: pb.SingleGenerationRequest, context) -> None:
        await self._serve(context, lambda: self._generate_stream(request, context), SHUTDOWN_MESSAGE)

    async def Tokenize(self, request: pb.BatchedTokenizeRequest, context) -> pb.BatchedTokenizeResponse:
        return await self._serve(context, lambda: self._tokenize(request), UNANSWERED_MESSAGE)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfoResponse:
        return await self._serve(context, self._model_info, UNANSWERED_MESSAGE)

    # -- what every RPC does -------------------------------------------------------------
    async def _serve(self, context, work: Callable[[], Awaitable], at_deadline: str):
        """Authorize, refuse while draining, run `work` until the drain deadline, and end the
        RPC with the status of any GatewayError it raises."""
        try:
            self._authorize(context)
            if self.drain.deadline is not None:
                raise GatewayError(ErrorKind.UNAVAILABLE, SHUTTING_DOWN)
            task = asyncio.ensure_future(work())
            deadline = asyncio.ensure_future(self.drain.until_deadline())
            try:
                await asyncio.wait({task, deadline}, return_when=asyncio.FIRST_COMPLETED)
                if not task.done():
                    raise GatewayError(ErrorKind.UNAVAILABLE, at_deadline)
                return task.result()
            finally:
                deadline.cancel()
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task  # its engine requests are aborted before the RPC ends
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error ends the RPC with its status
            error = as_gateway_error(exc)
            if error.kind is ErrorKind.INTERNAL and not isinstance(exc, GatewayError):
                logger.exception("a gRPC call failed")  # the client sees "internal error" only
            await context.abort(status_code(error.kind), details(error))

    def _authorize(self, context) -> None:
        key = self.service.settings.api_key
        if key is None:
            return
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not bearer_matches(header, key):
            raise GatewayError(ErrorKind.AUTHENTICATION, "invalid or missing API key (authorization: Bearer ...)")

    async def _prepare(self, texts: list[str], p: pb.Parameters, request) -> tuple[list[GrpcPlan], list]:
        """Check and tokenize every prompt, pre-compile the grammar, submit all or none."""
        service = adapter_service(request, self.service)
        check_batch(len(texts), service.settings)
        rp: RequestParams = request_params(p, service.settings)
        plans = [await off_loop(plan_prompt, service, text, rp) for text in texts]
        grammar = plans[0].params.grammar
        if grammar is not None:
            await compiled(service.client, grammar, "decoding")
        streams = await service.submit_all([(plan.prompt_ids, plan.params) for plan in plans])
        return plans, streams

    async def _admitted(self, texts: list[str], p: pb.Parameters, request):
        """Take a slot, then prepare; the slot is released if preparing fails."""
        return await Pipeline(self.service).start(lambda: self._prepare(texts, p, request))

    # -- Generate -------------------------------------------------------------------------
    async def _generate(self, request: pb.BatchedGenerationRequest) -> pb.BatchedGenerationResponse:
        texts = [r.text for r in request.requests]
        admission, (plans, streams) = await self._admitted(texts, request.params, request)
        builders = [ResponseBuilder(self.service.tokenizer, plan) for plan in plans]
        time_limited = False
        with _releasing(admission):
            try:
                async for index, out in _outputs(self.service, streams, plans[0].time_limit_s):
                    builders[index].add(out)
            except _TimeLimit:
                time_limited = True
        return pb.BatchedGenerationResponse(
            responses=[b.whole(time_limited and (b.last is None or not b.last.finished)) for b in builders])

    # -- GenerateStream -------------------------------------------------------------------
    async def _generate_stream(self, request: pb.SingleGenerationRequest, context) -> None:
        admission, (plans, streams) = await self._admitted([request.request.text], request.params, request)
        builder = ResponseBuilder(self.service.tokenizer, plans[0])
        with _releasing(admission):
            try:
                async for _, out in _outputs(self.service, streams, plans[0].time_limit_s):
                    if builder.first is None:
                        await context.write(builder.head(out))
                    tokens = builder.add(out)
                    await context.write(builder.step(out, tokens))
            except _TimeLimit:
                if builder.first is None:
                    await context.write(builder.head(None))
                await context.write(builder.time_limit())

    # -- Tokenize and ModelInfo -----------------------------------------------------------
    async def _tokenize(self, request: pb.BatchedTokenizeRequest) -> pb.BatchedTokenizeResponse:
        service = adapter_service(request, self.service)
        service.require_ready()
        check_batch(len(request.requests), service.settings)
        return await off_loop(_tokenize_all, service.tokenizer, request)

    async def _model_info(self) -> pb.ModelInfoResponse:
        self.service.require_ready()
        limits = self.service.limits
        return pb.ModelInfoResponse(model_kind=pb.ModelInfoResponse.DECODER_ONLY,
                                    max_sequence_length=limits.max_total_tokens,
                                    max_new_tokens=limits.max_total_tokens - 1)


@contextlib.contextmanager
def _releasing(admission: Admission):
    """Release the slot once: a success, the error, or a client gone (cancelled)."""
    try:
        yield
    except asyncio.CancelledError:
        admission.release(GatewayError(ErrorKind.INCOMPLETE, "the client went away before the answer was complete"))
        raise
    except BaseException as exc:
        admission.release(exc)
        raise
    admission.release()


async def _outputs(service: GenerationService, streams, time_limit_s: float | None):
    """The streams' merged outputs as (index, output); raises _TimeLimit once
    time_limit_s has passed. Ending early (either way) aborts the streams."""
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    outputs = service.merged(streams)
    try:
        while True:
            try:
                if deadline is None:
                    item = await anext(outputs)
                else:
                    item = await asyncio.wait_for(anext(outputs), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on, its own class on 3.10
                raise _TimeLimit() from None
            yield item
    finally:
        await outputs.aclose()


def _tokenize_all(tokenizer, request: pb.BatchedTokenizeRequest) -> pb.BatchedTokenizeResponse:
    """TGIS's Tokenize: the count, and with return_tokens / return_offsets the token strings
    and their character offsets; truncate_input_tokens keeps the last tokens."""
    keep = request.truncate_input_tokens or None
    response = pb.BatchedTokenizeResponse()
    for item in request.requests:
        if request.return_offsets:
            tokens = simple_tokens(tokenizer, item.text, True, keep)
            ids = [t["id"] for t in tokens]
        else:
            tokens = None
            ids = tokenizer.encode(item.text, add_special_tokens=True)
            if keep is not None:
                ids = ids[-keep:]
        entry = response.responses.add(token_count=len(ids))
        if request.return_tokens:
            entry.tokens.extend(tokenizer.convert_ids_to_tokens(ids))
        if tokens is not None:
            for t in tokens:
                entry.offsets.add(start=t["start"], end=t["stop"])
    return response
