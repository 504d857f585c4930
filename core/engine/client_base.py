"""The gateway's view of the engine: `EngineClient` (what routes call) and `RequestStream`
(one request's outputs, an async iterator). Implementations: core/engine/client.py (engine in a
thread) and core/engine/process.py (engine in its own process)."""
from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from .messages import EngineInfo, EngineLoad, StepStats
from ..errors import ValidationError
from ..scheduling.request import Request, RequestOutput

if TYPE_CHECKING:
    from ..grammar.spec import GrammarSpec


class RequestStream:
    """The outputs of one request, in order. Raises the engine's error if it failed."""

    def __init__(self, request: Request, abort: Callable[[str], None]):
        self.request_id = request.request_id
        self.num_prompt_tokens = request.num_prompt_tokens
        self.arrival_time = request.arrival_time
        self.first_token_time: float | None = None
        self.finished = False
        self._abort = abort
        self.loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def abort(self) -> None:
        """Withdraw the request if it is still running (idempotent)."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if self.first_token_time is None and item.new_token_ids:
            self.first_token_time = time.monotonic()
        if item.finished:
            self.finished = True
        return item


class EngineClient(ABC):
    """The interface the gateway talks to."""

    tokenizer: object
    info: EngineInfo | None
    # called with each step's StepStats, in the client's reader thread (the gateway's metrics)
    on_step: Callable[[StepStats], None] | None = None

    @abstractmethod
    async def add_requests(self, requests: list[Request]) -> list[RequestStream]:
        """Queue several requests together (the n sequences of a prompt); all or none.
        Raises ValidationError if the engine rejects one."""

    async def add_request(self, request: Request) -> RequestStream:
        return (await self.add_requests([request]))[0]

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile (and cache) a grammar before submitting the request that uses it;
        raises GrammarError if it is invalid, unsupported or too slow to compile."""

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (core/lora); raises the engine's refusal
        (a bad adapter changes nothing). The default: this engine serves no adapters."""
        raise ValidationError("this engine serves no LoRA adapters")

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` to new requests (those running with it finish)."""
        raise ValidationError("this engine serves no LoRA adapters")

    @property
    @abstractmethod
    def ready(self) -> bool:
        """True once the model is loaded and warmed up, and while the engine serves."""

    @property
    def num_unfinished(self) -> int:
        return 0

    @property
    def load(self) -> EngineLoad | None:
        """The engine's latest load, or None if it does not report one."""
        return None

    @property
    def failure(self) -> BaseException | None:
        """Why the engine cannot serve: its start-up error, or why it died; None while fine."""
        return None

    @property
    def engine_gone(self) -> bool:
        """The engine has ended or failed for good (it will not become ready): `failure`, or an
        engine found gone before `failure` is set (/health then drops Retry-After)."""
        return self.failure is not None

    def start(self) -> None:
        """Begin loading the model (returns at once)."""

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until ready; raises the start-up error if loading failed."""

    async def wait_failure(self) -> BaseException:
        """Until the engine fails (start-up or later); returns why."""
        while self.failure is None:
            await asyncio.sleep(0.1)
        return self.failure

    async def shutdown(self, timeout: float = 10.0) -> None: ...
