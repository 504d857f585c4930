"""What both dialects do with the engine: admit, tokenize, check lengths, submit,
collect or merge outputs, and record metrics. Routes stay thin."""
from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from switchyard.core.text.chat_template import ChatTemplateError, render_chat
from switchyard.core.engine.client import EngineClient, EngineDeadError, RequestStream
from switchyard.core.grammar import GrammarUnavailable
from switchyard.core.params import SamplingParams, ValidationError
from switchyard.core.pooling.params import PoolingParams
from switchyard.core.scheduling.request import FinishReason, Request, RequestOutput, pooling_request

from .errors import ErrorKind, GatewayError
from .lora.adapters import LoraAdapters
from .metrics import Metrics
from .settings import Limits, ServerSettings
from .tracing import current as current_trace


@dataclass(frozen=True)
class Completion:
    """One finished sequence, collected from its stream."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[float, ...] | None  # per generated token
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None
    num_prompt_tokens: int
    stop_reason: int | None  # the stop token id that ended it
    # (token id, logprob or None for the first, top-n) per prompt token, when asked for
    prompt_logprobs: tuple | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Timings:
    """TGI's x-* timing headers, in seconds."""

    validation: float
    queue: float
    inference: float
    total: float


class Admission:
    """One slot of --max-concurrent-requests, released exactly once."""

    def __init__(self, service: GenerationService):
        self._service = service
        self.received_at = time.monotonic()
        self._released = False

    def release(self, error: BaseException | None = None) -> None:
        """Free the slot; counts the request as a success, or as a failure of `error`'s kind."""
        if self._released:
            return
        self._released = True
        service = self._service
        service._slots.in_flight -= 1
        service.metrics.requests_in_flight.set(service._slots.in_flight)
        if error is None:
            service.metrics.request_success.inc()
        else:
            kind = error.kind if isinstance(error, GatewayError) else ErrorKind.INTERNAL
            service.metrics.request_failure.inc(err=kind.value.tgi_type)


async def until_disconnected(work: Awaitable, http_request, streams: list[RequestStream], gone_error: BaseException):
    """Await `work`; if the HTTP client goes away first, abort the streams (their KV
    blocks are freed by the next step) and raise `gone_error`. Waits on `receive()`
    for `http.disconnect` (the body has been read, so nothing else arrives)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(http_request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise gone_error
        return task.result()
    finally:
        for pending in (task, gone):
            if not pending.done():
                pending.cancel()
        for stream in streams:
            stream.abort()


async def _client_gone(http_request) -> None:
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


def engine_error(exc: EngineDeadError | ValidationError) -> GatewayError:
    """What the engine's refusal or failure of a request is for its client: a grammar the
    server could not compile just now is a 503, any other ValidationError (the request's
    limits, a grammar that does not compile) the client's to fix, a failed step a generation error."""
    if isinstance(exc, GrammarUnavailable):
        return GatewayError(ErrorKind.UNAVAILABLE, str(exc))
    if isinstance(exc, ValidationError):
        return GatewayError(ErrorKind.VALIDATION, str(exc), exc.param)
    return GatewayError(ErrorKind.GENERATION, str(exc))


class _Slots:
    """Requests in flight on one engine, shared by its adapter views (GenerationService.with_adapter)."""

    in_flight = 0


class GenerationService:
    """What the routes ask of one engine. A view of it bound to a LoRA adapter (with_adapter)
    shares its client, limits and concurrency slots, and submits requests that run with the adapter."""

    lora_name: str | None = None  # the adapter this view's requests run with (None: the base model)

    def __init__(self, client: EngineClient, settings: ServerSettings, metrics: Metrics):
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self._slots = _Slots()
        self._limits: Limits | None = None
        self.adapters = LoraAdapters(settings.lora, (settings.model_id, *settings.served_model_names))

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet released, of the engine and all its adapter views."""
        return self._slots.in_flight

    def with_adapter(self, name: str | None, param: str = "adapter_id") -> GenerationService:
        """This service for requests naming `name` as their adapter: itself for None, "" or one of the
        model's own names; a view bound to the adapter for a served one; a 404 naming `param` otherwise."""
        if name in (None, "", self.settings.model_id, *self.settings.served_model_names):
            return self
        if not self.adapters.enabled:
            raise GatewayError(ErrorKind.VALIDATION, f"LoRA adapters are not supported by this server (start it with "
                               f"--lora-adapters or --enable-lora): `{param}` must be null. Given: {name!r}", param)
        if name not in self.adapters:
            served = ", ".join(n for n, _ in self.adapters.items()) or "none"
            raise GatewayError(ErrorKind.MODEL_NOT_FOUND, f"no LoRA adapter named {name!r} is served "
                               f"(adapters: {served})", param)
        view = copy.copy(self)
        view.lora_name = name
        return view

    # -- what the routes ask -------------------------------------------------------
    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def limits(self) -> Limits:
        if self._limits is None:
            self._limits = Limits.resolve(self.settings, self.client.info.max_model_len)
        return self._limits

    def admit(self) -> Admission:
        """Take a concurrency slot or fail with 429 at once."""
        self.require_ready()
        self.metrics.request_count.inc()
        if self._slots.in_flight >= self.settings.max_concurrent_requests:
            self.metrics.request_failure.inc(err="overloaded")
            raise GatewayError(ErrorKind.OVERLOADED, "Model is overloaded")
        self._slots.in_flight += 1
        self.metrics.requests_in_flight.set(self._slots.in_flight)
        return Admission(self)

    def require_ready(self) -> None:
        """503 (with Retry-After) unless the engine serves: still loading, or stopped for good."""
        if self.client.failure is not None:
            raise self.engine_stopped()
        if not self.client.ready:
            raise GatewayError(ErrorKind.UNAVAILABLE, "the model is still loading")

    def require_generation(self) -> None:
        """A 400 when the model is served for embeddings (core/pooling): it generates no text."""
        info = self.client.info
        if info is not None and info.pooling is not None:
            raise GatewayError(ErrorKind.VALIDATION, f"model `{self.settings.model_id}` is served for embeddings "
                               "(--task embed): it does not generate text; ask /v1/embeddings or /embed", "model")

    def engine_stopped(self) -> GatewayError:
        """The engine died or failed to load: the server is exiting (a supervisor restarts it)."""
        return GatewayError(ErrorKind.UNAVAILABLE, f"the engine stopped: {self.client.failure}")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The chat template applied to `messages`: a TEMPLATE error if the model has none
        (a base model without --chat-template) or if it fails."""
        try:
            return render_chat(self.tokenizer, messages, add_generation_prompt, **template_kwargs)
        except ChatTemplateError as exc:
            raise GatewayError(ErrorKind.TEMPLATE, str(exc), exc.param) from exc

    def check_lengths(self, num_prompt_tokens: int, max_new_tokens: int | None, param: str = "prompt") -> int:
        """TGI's length rules; returns max_new_tokens (filled in when None)."""
        limits = self.limits
        if num_prompt_tokens == 0:
            raise GatewayError(ErrorKind.VALIDATION, "the input must not be empty", param)
        if num_prompt_tokens > limits.max_input_tokens:
            raise GatewayError(ErrorKind.VALIDATION, f"`inputs` tokens must be <= {limits.max_input_tokens}. "
                               f"Given: {num_prompt_tokens}", param)
        room = limits.max_total_tokens - num_prompt_tokens
        if max_new_tokens is None:
            return room
        if num_prompt_tokens + max_new_tokens > limits.max_total_tokens:
            raise GatewayError(ErrorKind.VALIDATION, f"`inputs` tokens + `max_new_tokens` must be <= "
                               f"{limits.max_total_tokens}. Given: {num_prompt_tokens} `inputs` tokens and "
                               f"{max_new_tokens} `max_new_tokens`", "max_tokens")
        return max_new_tokens

    # -- the engine ----------------------------------------------------------------
    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     arrival_time: float | None = None) -> RequestStream:
        request = Request(request_id or uuid.uuid4().hex, list(prompt_ids), params)
        return (await self._add([request], arrival_time))[0]

    async def submit_all(self, prompts: list[tuple[list[int], SamplingParams]],
                         arrival_time: float | None = None, images: tuple = ()) -> list[RequestStream]:
        """Submit several sequences (prompts x n) in one engine command; all or none. They
        form one share group, admitted together: the n / best_of sequences of a prompt
        share its KV blocks even with prefix caching off. `images` (core/multimodal ImageData):
        every prompt's, one per image placeholder, in order."""
        base = uuid.uuid4().hex
        return await self._add([Request(f"{base}-{i}", list(ids), params, share_group=base, images=tuple(images))
                                for i, (ids, params) in enumerate(prompts)], arrival_time)

    async def submit_pooling(self, prompts: list[list[int]], params: PoolingParams,
                             arrival_time: float | None = None) -> list[RequestStream]:
        """Submit one pooling (embedding) request per prompt in one engine command; all or none.
        No share group: each prompt is its own, and a pooling request shares no block."""
        base = uuid.uuid4().hex
        return await self._add([pooling_request(f"{base}-{i}", ids, params) for i, ids in enumerate(prompts)],
                               arrival_time)

    async def _add(self, requests: list[Request], arrival_time: float | None) -> list[RequestStream]:
        for request in requests:
            if arrival_time is not None:
                request.arrival_time = arrival_time
            request.lora_name = self.lora_name
        trace = current_trace()
        if trace is not None:
            trace.on_submit(requests)
        try:
            streams = await self.client.add_requests(requests)
        except EngineDeadError as exc:
            if self.client.failure is not None:  # died before taking them
                raise self.engine_stopped() from exc
            raise engine_error(exc) from exc
        except ValidationError as exc:
            raise engine_error(exc) from exc
        for request in requests:
            self.metrics.request_input_length.observe(request.num_prompt_tokens)
            if request.pooling is None and request.sampling_params.max_tokens is not None:
                self.metrics.request_max_new_tokens.observe(request.sampling_params.max_tokens)
        return streams

    async def collect(self, stream: RequestStream) -> Completion:
        """Wait for a stream to finish; aborts it if the caller is cancelled."""
        pieces: list[str] = []
        token_ids: list[int] = []
        logprobs: list[float] = []
        top: list = []
        prompt_logprobs = None
        try:
            async for out in stream:
                if out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
                pieces.append(out.new_text)
                token_ids.extend(out.new_token_ids)
                logprobs.extend(out.logprobs or ())
                top.extend(out.top_logprobs or ())
                last = out
        except (EngineDeadError, ValidationError) as exc:  # e.g. a grammar that failed after submission
            raise engine_error(exc) from exc
        finally:
            stream.abort()
        self.record(stream, last)
        return Completion("".join(pieces), tuple(token_ids), last.finish_reason,
                          tuple(logprobs) if last.logprobs is not None else None,
                          tuple(top) if last.top_logprobs is not None else None,
                          last.num_prompt_tokens, last.stop_reason, prompt_logprobs, last.num_cached_tokens)

    async def collect_pooled(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Each pooling request's one output (its embedding), in order; aborts what is left if
        one fails or the caller is cancelled."""
        async def one(stream: RequestStream) -> RequestOutput:
            last = None
            try:
                async for out in stream:
                    last = out
            except (EngineDeadError, ValidationError) as exc:
                raise engine_error(exc) from exc
            if last is None or last.embedding is None:
                raise GatewayError(ErrorKind.GENERATION, "the engine returned no embedding")
            self.record(stream, last)
            return last

        try:
            return list(await asyncio.gather(*(one(s) for s in streams)))
        finally:
            for stream in streams:
                stream.abort()

    async def collect_all(self, streams: list[RequestStream]) -> list[Completion]:
        try:
            return list(await asyncio.gather(*(self.collect(s) for s in streams)))
        finally:
            for stream in streams:
                stream.abort()

    async def merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as (index, output), as they come. Aborts what is
        left if the consumer stops early (client disconnect)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((index, out))
                    if out.finished:
                        self.record(stream, out)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                await queue.put((index, exc))
            await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, (EngineDeadError, ValidationError)):  # e.g. a grammar that failed
                    raise engine_error(item) from item
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                if not stream.finished:
                    self.metrics.requests_aborted.inc()
                stream.abort()

    # -- bookkeeping ---------------------------------------------------------------
    def record(self, stream: RequestStream, last: RequestOutput) -> None:
        """Metrics of one finished sequence."""
        now = time.monotonic()
        m = self.metrics
        m.request_duration.observe(now - stream.arrival_time)
        m.request_generated_tokens.observe(last.num_output_tokens)
        m.prompt_tokens.inc(last.num_prompt_tokens)
        m.generation_tokens.inc(last.num_output_tokens)
        timings = self.timings(stream, last, stream.arrival_time)
        trace = current_trace()
        if trace is not None:
            trace.on_finished(last, timings)
        m.request_queue_duration.observe(timings.queue)
        m.request_inference_duration.observe(timings.inference)
        if stream.first_token_time is not None:
            m.time_to_first_token.observe(stream.first_token_time - stream.arrival_time)
            if last.num_output_tokens > 1:
                mean_itl = (now - stream.first_token_time) / (last.num_output_tokens - 1)
                m.inter_token_latency.observe(mean_itl)
        if last.num_output_tokens:
            m.request_mean_time_per_token_duration.observe(timings.inference / last.num_output_tokens)

    @staticmethod
    def timings(stream: RequestStream, last: RequestOutput | None, received_at: float) -> Timings:
        now = time.monotonic()
        scheduled = (last.first_scheduled_time if last is not None else None) or stream.arrival_time
        return Timings(validation=max(0.0, stream.arrival_time - received_at),
                       queue=max(0.0, scheduled - stream.arrival_time),
                       inference=max(0.0, now - scheduled), total=max(0.0, now - received_at))
