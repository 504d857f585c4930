"""EngineClient: the gateway's handle on the engine.

`add_request(request)` returns a `RequestStream`, an async iterator of
`RequestOutput`s; `abort(request_id)` withdraws a request and frees its blocks
before the next step. The engine runs its step loop (core/engine/loop.py) either in a
thread of this process (`InProcessEngineClient`: offline use and tests) or in its own
process (`ProcessEngineClient`, core/engine/process.py: `switchyard serve`); both talk to
it with the same messages (core/engine/messages.py) over a channel, and a reader thread
hands each step's outputs to their streams: one wake-up per event loop per step, so the
gateway's event loop never waits on a step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from .client_base import EngineClient, RequestStream
from .channel import Channel, queue_pair
from .loop import serve_engine
from .messages import (Abort, AddRequests, CompileGrammar, Dead, EngineInfo, EngineLoad, LoadChanged, LoadLora,
                              ModelChecked, Ready, Settled, StartupFailed, StepDone, StepFailed, StepStats, Stop, UnloadLora)
from ..errors import EngineDeadError
from ..scheduling.request import Request, RequestOutput
from ..text.chat_template import sample_turn
from ..text.serving_tokenizer import ServingTokenizer

if TYPE_CHECKING:
    from ..config import TracingConfig
    from ..grammar.spec import GrammarSpec

__all__ = ["ChannelEngineClient", "EngineClient", "EngineDeadError", "EngineLoad", "InProcessEngineClient",
           "RequestStream", "StepStats"]
logger = logging.getLogger(__name__)


class ChannelEngineClient(EngineClient):
    """The client side of engine_messages over a Channel; subclasses start the engine
    (`_open`), tell whether it still runs (`_ended`) and stop it (`_close`)."""

    def __init__(self, on_step: Callable[[StepStats], None] | None = None):
        self.on_step = on_step
        self.tokenizer = None
        self.info: EngineInfo | None = None
        self.startup_error: BaseException | None = None
        self._failure: BaseException | None = None
        self._load: EngineLoad | None = None  # replaced whole by the reader thread
        self._ready = threading.Event()
        self._model_checked = threading.Event()
        self.model_description: str | None = None  # from ModelChecked, when the engine sends it
        self._channel: Channel | None = None
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._lock = threading.Lock()  # guards _streams and _pending
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()

    @abstractmethod
    def _open(self) -> Channel:
        """Start the engine; the owner's end of its channel."""

    @abstractmethod
    def _ended(self, wait_s: float = 0.0) -> str | None:
        """Why the engine is gone (e.g. its process's exit code), or None while it runs
        (after waiting up to `wait_s` for it to end; with 0, at once: `ready` asks each call)."""

    @abstractmethod
    def _close(self, timeout: float) -> None:
        """After Stop was sent: wait for the engine to end (force it past `timeout`)."""

    # -- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self._channel is None:
            self._channel = self._open()
            self._reader = threading.Thread(target=self._read, name="switchyard-engine-reader", daemon=True)
            self._reader.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set():
            if self._failure is not None:
                raise self._failure
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the engine did not become ready in time")
            await asyncio.sleep(0.05)

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._channel is None or self._stopping:
            return
        self._stopping = True
        self._ready.clear()
        self._channel.send(Stop())
        await asyncio.to_thread(self._close, timeout)

    @property
    def ready(self) -> bool:
        """Warmed up, and the engine still runs, asked at each call: a killed engine process is
        not ready from the moment it has ended, before the reader thread sees its channel close."""
        return self._ready.is_set() and not self._engine_ended()

    @property
    def engine_gone(self) -> bool:
        return self._failure is not None or self._engine_ended()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def _engine_ended(self) -> bool:
        """Whether the engine has ended, asked now without waiting (never before it started)."""
        return self._channel is not None and self._ended() is not None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def load(self) -> EngineLoad | None:
        return self._load

    # -- requests (any event loop) ---------------------------------------------------------
    async def add_requests(self, requests: list[Request]) -> list[RequestStream]:
        """One command for all: the engine adds them before its next step, so the n
        sequences of a prompt are admitted together and share its blocks; all or none."""
        self._check_serving()
        if not requests:
            return []
        streams = [RequestStream(request, self.abort) for request in requests]
        token, future = self._expect_answer()
        with self._lock:
            self._streams.update((s.request_id, s) for s in streams)
        self._channel.send(AddRequests(token, tuple(requests)))
        try:
            await future
        except BaseException:  # refused, or our caller went away: withdraw what the engine may hold
            for stream in streams:
                stream.abort()
            raise
        return streams

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compiles on the engine's grammar workers (never on the step loop or this event
        loop); the later add_request of a request with this spec hits the cache."""
        await self._command(lambda token: CompileGrammar(token, spec))

    async def load_lora(self, name: str, path: str) -> None:
        await self._command(lambda token: LoadLora(token, name, path))

    async def unload_lora(self, name: str) -> None:
        await self._command(lambda token: UnloadLora(token, name))

    async def _command(self, make) -> None:
        """Send the command `make(token)` and wait for the engine's Settled answer. Shielded: a
        caller that goes away cancels neither the command (a compile others share, a load) nor
        its answer, whose outcome is then nobody's (taken, so asyncio logs no "never retrieved")."""
        self._check_serving()
        token, future = self._expect_answer()
        self._channel.send(make(token))
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_retrieved)
            raise

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine frees the request before its next step."""
        if self._forget(request_id) and not self._stopping:
            self._channel.send(Abort(request_id))

    def _check_serving(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(f"the engine is not running: {self._failure}")
        if not self.ready:
            raise EngineDeadError("the engine is not ready")

    def _expect_answer(self) -> tuple[int, asyncio.Future]:
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            token = next(self._tokens)
            self._pending[token] = future
        return token, future

    def _forget(self, request_id: str) -> bool:
        with self._lock:
            return self._streams.pop(request_id, None) is not None

    # -- the reader thread -------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                event = self._channel.recv(0.5)
            except EOFError:
                if not self._stopping:
                    self._die(EngineDeadError(self._ended(wait_s=2.0) or "the engine closed its channel"))
                return
            if event is None:
                ended = self._ended()
                if ended is not None and not self._stopping:
                    self._die(EngineDeadError(ended))
                    return
                continue
            self._handle(event)
            if isinstance(event, (Dead, StartupFailed)):
                return

    def _handle(self, event) -> None:
        if isinstance(event, StepDone):
            self._deliver([(out.request_id, out if out.error is None else out.error) for out in event.outputs])
            self._load = event.load
            self._observe(event.stats)
        elif isinstance(event, Settled):
            with self._lock:
                future = self._pending.pop(event.token, None)
            if future is not None:
                _settle_threadsafe(future, event.error)
        elif isinstance(event, LoadChanged):
            self._load = event.load
        elif isinstance(event, StepFailed):
            error = EngineDeadError(f"generation failed: {event.error}")
            self._deliver([(request_id, error) for request_id in event.request_ids])
            self._load = event.load
        elif isinstance(event, ModelChecked):
            self.model_description = event.description
            self._model_checked.set()
        elif isinstance(event, Ready):
            tokenizer = event.tokenizer.build() if isinstance(event.tokenizer, ServingTokenizer) else event.tokenizer
            sample_turn(tokenizer, "Warm-up.")  # this process's copy of the chat template, compiled before ready
            self.info, self.tokenizer, self._load = event.info, tokenizer, event.load
            self._ready.set()
        elif isinstance(event, StartupFailed) and self._stopping:
            logger.info("the engine, asked to stop while starting, did not start: %s", event.error)
        elif isinstance(event, StartupFailed):
            self.startup_error = event.error
            self._failure = event.error
            self._model_checked.set()
        elif isinstance(event, Dead):
            self._die(event.error)

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams: one wake-up per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue  # aborted meanwhile
                by_loop.setdefault(stream.loop, []).append((stream, item))
                if isinstance(item, BaseException) or item.finished:
                    del self._streams[request_id]
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed (its server stopped): nobody reads these
                for stream, _ in batch:
                    self.abort(stream.request_id)

    def _observe(self, stats: StepStats) -> None:
        if self.on_step is None:
            return
        try:
            self.on_step(stats)
        except Exception:  # noqa: BLE001 - a metrics bug must not stop the engine
            logger.exception("the step observer failed")

    def _die(self, error: BaseException) -> None:
        """The engine is gone: every stream and waiting caller gets the error; not ready."""
        if not isinstance(error, EngineDeadError):
            error = EngineDeadError(f"the engine failed: {type(error).__name__}: {error}")
        self._ready.clear()  # /health: 503 from now on
        logger.error("the engine stopped serving: %s", error)
        with self._lock:
            request_ids = list(self._streams)
            pending, self._pending = list(self._pending.values()), {}
        self._deliver([(request_id, error) for request_id in request_ids])
        for future in pending:
            _settle_threadsafe(future, error)
        self._failure = error  # last: the gateway exits on it, after the streams got their error
        self._model_checked.set()  # a start-up that waits for the check gets the failure


class InProcessEngineClient(ChannelEngineClient):
    """Runs the engine loop in a background thread; `engine_factory()` returns
    (engine_core, tokenizer) and runs in that thread, so loading the model does not hold
    up the HTTP server (which answers /health with 503 meanwhile). `engine` is the
    EngineCore once built (tests inspect it). `tracing`: the engine's spans, as the engine
    process would export them (core/tracing.py)."""

    def __init__(self, engine_factory: Callable[[], tuple[object, object]],
                 on_step: Callable[[StepStats], None] | None = None, warm_up: bool = True,
                 tracing: TracingConfig | None = None):
        super().__init__(on_step)
        self._engine_factory = engine_factory
        self._warm_up = warm_up
        self._tracing = tracing
        self._thread: threading.Thread | None = None
        self.engine = None

    def _open(self) -> Channel:
        mine, theirs = queue_pair()

        def run() -> None:
            try:
                serve_engine(theirs, self._build, self._warm_up, self._tracing)
            finally:
                theirs.close()

        self._thread = threading.Thread(target=run, name="switchyard-engine", daemon=True)
        self._thread.start()
        return mine

    def _build(self) -> tuple[object, object]:
        self.engine, tokenizer = self._engine_factory()
        return self.engine, tokenizer

    def _ended(self, wait_s: float = 0.0) -> str | None:
        if wait_s > 0:
            self._thread.join(wait_s)
        return None if self._thread.is_alive() else "the engine thread ended"

    def _close(self, timeout: float) -> None:
        self._thread.join(timeout)


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)


def _settle_threadsafe(future: asyncio.Future, error: BaseException | None) -> None:
    try:
        future.get_loop().call_soon_threadsafe(_settle, future, error)
    except RuntimeError:  # its event loop is closed: nobody waits
        pass


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
