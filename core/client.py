"""EngineClient: the gateway's handle on the engine.

`add_request(request)` returns a `RequestStream`, an async iterator of
`RequestOutput`s; `abort(request_id)` withdraws a request and frees its blocks
before the next step. The in-process client runs the step loop in one thread;
the gateway's event loop only enqueues commands and receives outputs, so a
slow step never blocks HTTP.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import EngineDeadError  # noqa: F401 - re-exported for the gateway
from .request import FinishReason, Request, RequestOutput

if TYPE_CHECKING:
    from .grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """What one engine step did, reported to the gateway's metrics."""

    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decodes: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    duration_s: float
    # prefix cache, over this step's admissions: prompt tokens looked up, and found cached
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now: published after every step and every command it applies
    (an abort frees blocks with no step after it), so metrics are true when idle."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int


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
    """The interface the gateway talks to (in-process now; over a socket later)."""

    tokenizer: object
    info: object  # core.engine.EngineInfo

    @abstractmethod
    async def add_request(self, request: Request) -> RequestStream:
        """Queue a request; raises ValidationError if the engine rejects it."""

    async def add_requests(self, requests: list[Request]) -> list[RequestStream]:
        """Queue several requests together (the n sequences of a prompt); all or none."""
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(await self.add_request(request))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile (and cache) a grammar before submitting the request that uses it;
        raises GrammarError if it is invalid, unsupported or too slow to compile. The
        default does nothing: errors then surface when the request's stream is read."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """True once the model is loaded and warmed up."""

    @property
    def num_unfinished(self) -> int:
        return 0

    @property
    def load(self) -> EngineLoad | None:
        """The engine's latest load, or None if it does not report one."""
        return None

    def start(self) -> None:
        """Begin loading the model (returns at once)."""

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until ready; raises the start-up error if loading failed."""

    async def shutdown(self, timeout: float = 10.0) -> None: ...


_ADD, _ABORT, _STOP = "add", "abort", "stop"


class InProcessEngineClient(EngineClient):
    """Runs EngineCore in a background thread built by `engine_factory`.

    `engine_factory()` returns (engine_core, tokenizer); it runs in the engine thread
    so that loading the model does not hold up the HTTP server (which answers
    /health with 503 meanwhile). Streams may live on any event loop."""

    def __init__(self, engine_factory: Callable[[], tuple[object, object]],
                 on_step: Callable[[StepStats], None] | None = None, warm_up: bool = True):
        self._engine_factory = engine_factory
        self.on_step = on_step  # called in the engine thread after each step
        self._warm_up = warm_up
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.startup_error: BaseException | None = None
        self.engine = None
        self.tokenizer = None
        self.info = None
        self._load: EngineLoad | None = None  # replaced whole by the engine thread

    # -- life cycle ---------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (loads the model, warms up, then steps)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="switchyard-engine", daemon=True)
            self._thread.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set():
            if self.startup_error is not None:
                raise self.startup_error
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the engine did not become ready in time")
            await asyncio.sleep(0.05)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put((_STOP, None, None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def load(self) -> EngineLoad | None:
        return self._load

    # -- requests (any event loop) -------------------------------------------------
    async def add_request(self, request: Request) -> RequestStream:
        return (await self.add_requests([request]))[0]

    async def add_requests(self, requests: list[Request]) -> list[RequestStream]:
        """One command for all: the engine adds them before its next step, so the n
        sequences of a prompt are admitted together and share its blocks; all or none."""
        if not self.ready:
            raise EngineDeadError("the engine is not ready")
        if not requests:
            return []
        streams = [RequestStream(request, self.abort) for request in requests]
        accepted: asyncio.Future = streams[0].loop.create_future()
        self._commands.put((_ADD, list(zip(requests, streams)), accepted))
        await accepted
        return streams

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compiles on the engine's grammar workers (never on the step loop or this event
        loop); the later add_request of a request with this spec hits the cache."""
        if not self.ready:
            raise EngineDeadError("the engine is not ready")
        # shielded: a caller that goes away must not cancel the compile others share
        await asyncio.shield(asyncio.wrap_future(self.engine.grammar_service.compile(spec)))

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine frees the request before its next step."""
        self._commands.put((_ABORT, request_id, None))

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine, self.tokenizer = self._engine_factory()
            self.info = self.engine.info
            from .output_processor import OutputProcessor

            self._processor = OutputProcessor(self.tokenizer, self.engine.finish_request)
            if self._warm_up:
                self._warm_up_engine()
        except BaseException as exc:  # noqa: BLE001 - reported to the gateway, which exits
            logger.exception("engine start-up failed")
            self.startup_error = exc
            return
        self._publish_load()
        self._ready.set()
        logger.info("engine warmed up and ready")
        while self._handle_commands(block=not self.engine.has_unfinished_requests()):
            if self.engine.has_unfinished_requests():
                self._step()
        self.engine.shutdown()  # its grammar workers and shards go with it

    def _warm_up_engine(self) -> None:
        from .params import SamplingParams

        ids = self.tokenizer.encode("Warm-up") or [0]
        self.engine.add_request(Request("warm-up", ids, SamplingParams(max_tokens=2, temperature=0.0,
                                                                        ignore_eos=True)))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                kind, payload, future = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == _STOP:
                return False
            if kind == _ADD:
                self._add(payload, future)
            elif kind == _ABORT:
                self._abort_request(payload)
            if self._commands.empty():
                self._publish_load()

    def _add(self, pairs: list[tuple[Request, RequestStream]], future: asyncio.Future) -> None:
        added: list[str] = []
        try:
            for request, stream in pairs:
                self.engine.add_request(request)
                self._streams[request.request_id] = stream
                added.append(request.request_id)
                self._processor.add_request(request)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller; all or none
            for request_id in added:
                self._abort_request(request_id)
            future.get_loop().call_soon_threadsafe(_settle, future, exc)
            return
        future.get_loop().call_soon_threadsafe(_settle, future, None)

    def _abort_request(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.finish_request(request_id, FinishReason.ABORT)
            self._processor.remove_request(request_id)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self._processor.process(self.engine.step())
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            logger.exception("engine step failed; failing the requests in flight")
            error = EngineDeadError(f"generation failed: {exc}")
            for request_id, stream in list(self._streams.items()):
                self._abort_request(request_id)
                stream.loop.call_soon_threadsafe(stream.put, error)
            return
        if outputs:
            self._dispatch(outputs)
        self._publish_load()
        if self.on_step is not None:
            try:
                self.on_step(self._step_stats(time.perf_counter() - start))
            except Exception:  # noqa: BLE001 - a metrics bug must not stop the engine
                logger.exception("the step observer failed")

    def _publish_load(self) -> None:
        scheduler = self.engine.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        self._load = EngineLoad(num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
                                num_kv_blocks_used=pool.num_usable_blocks - pool.num_free_blocks,
                                num_kv_blocks_total=pool.num_usable_blocks)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams: one wake-up per event loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            by_loop.setdefault(stream.loop, []).append((stream, out if out.error is None else out.error))
            if out.finished:
                del self._streams[out.request_id]
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed (its server stopped): nobody reads these
                for stream, _ in items:
                    self._abort_request(stream.request_id)

    def _step_stats(self, duration_s: float) -> StepStats:
        scheduler = self.engine.scheduler
        last = self.engine.last_scheduler_output
        scheduled = last.scheduled if last is not None else ()
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        num_decodes = sum(1 for s in scheduled if s.num_new_tokens == 1)
        pool = scheduler.kv_cache_manager.block_pool
        return StepStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_scheduled_tokens=num_tokens, num_prefill_tokens=num_tokens - num_decodes, num_decodes=num_decodes,
            num_kv_blocks_used=pool.num_usable_blocks - pool.num_free_blocks,
            num_kv_blocks_total=pool.num_usable_blocks, duration_s=duration_s,
            num_prefix_queried_tokens=last.num_prefix_queried_tokens if last is not None else 0,
            num_prefix_hit_tokens=last.num_prefix_hit_tokens if last is not None else 0)


def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, out in items:
        stream.put(out)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
