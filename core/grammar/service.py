"""Compiles grammars off the step loop, isolated and bounded.

`compile(spec)` returns a concurrent.futures.Future at once: already resolved on a cache
hit (or for a spec over `max_spec_bytes`), else resolved by a slot. Each slot is a thread
that hands one spec at a time to its executor: a low-priority worker process for a portable
compiler (executors.py; on the engine's CPUs, placement.py), else a thread. There are
`compile_workers` slots for specs of any size, taken smallest first, and one spare slot whose
worker is started ahead (warm) and which takes only specs of at most `spare_max_spec_bytes`
(64 KiB by default): a small or medium schema never waits behind heavy compiles busy on every other
slot, nor for a worker to start. A worker that ends while idle is replaced at once.

A compile past `compile_timeout_s` is killed with its worker process (its slot starts a
fresh one while idle) and blamed in one place, `timeout_error`: on the schema (GrammarError,
a 400) if it had at least half a core all that time, else on the server, whose other work
starved the niced worker (GrammarUnavailable, a 503 a retry may pass). A schema with no
finite instance (finite.py) fails before any worker. What else the server could not do (no
worker started in time, one ended under the compile, the service shut down) fails with
GrammarUnavailable too. Neither a timeout nor an unavailability is ever cached, so a retry
compiles afresh. Compiled grammars, and the failures of invalid specs, are cached by spec,
LRU, bounded in entries and bytes (cache.py); one larger than the whole byte bound is
refused. `shutdown()` (and interpreter exit) kills the worker processes.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Collection
from concurrent.futures import Future

from ..config import GrammarConfig
from .base import CompiledGrammar, GrammarCompiler, check_size, param_of
from .cache import GrammarCache
from .executors import CompileTimeout, ProcessExecutor, ThreadExecutor, WorkerStartError
from .finite import check_finite
from .placement import worker_cpus
from .spec import GrammarError, GrammarSpec, GrammarUnavailable

logger = logging.getLogger(__name__)


class GrammarCompileService:
    """One per engine (and so per tokenizer). Thread-safe. `make_compiler` runs on the
    first slot, so building the tokenizer tables never holds up the caller either. `cpus`:
    the engine's own (ParallelConfig.cpus), on which its workers run; None: the machine's."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], config: GrammarConfig = GrammarConfig(),
                 cpus: Collection[int] | None = None):
        self.config = config
        self.cpus = worker_cpus(cpus)
        self.compile_workers = config.compile_workers_on(self.cpus)
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Condition()  # the cache, the queue, the slots
        self._compiler_lock = threading.Lock()
        self._cache = GrammarCache(config.cache_size, config.cache_bytes)
        self._queue: list[tuple[int, int, GrammarSpec, Future]] = []  # heap: (size, order, spec, future)
        self._order = itertools.count()
        self._num_slots = 0  # slots for any size started so far (at most compile_workers)
        self._closed = False
        self._executors: list = []  # the slots' executors, for shutdown
        self._finalizer = weakref.finalize(self, _close_all, self._executors)
        self.num_hits = 0
        self.num_misses = 0
        self.num_timeouts = 0

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the CompiledGrammar (or of a GrammarError)."""
        size = len(spec.value.encode())
        if size > self.config.max_spec_bytes:
            return _failed(GrammarError(f"the {_what(spec)} is {size} bytes, more than this server's limit of "
                                        f"{self.config.max_spec_bytes} (--grammar-max-spec-bytes)", param_of(spec)))
        with self._lock:
            if self._closed:
                return _failed(GrammarUnavailable("the grammar compiler is shut down", param_of(spec)))
            future = self._cache.get(spec)
            if future is not None:
                self.num_hits += 1
                return future
            self.num_misses += 1
            future = Future()
            self._cache.add(spec, future)
            heapq.heappush(self._queue, (size, next(self._order), spec, future))
            if self._num_slots == 0 and self.config.spare_max_spec_bytes > 0:
                self._start_slot(spare=True)  # with the first slot, so it is warm by the time it is needed
            if self._num_slots < self.compile_workers:
                self._num_slots += 1
                self._start_slot(spare=False)
            self._lock.notify_all()  # a spare woken for a spec too large for it waits on
        return future

    def __contains__(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    @property
    def cache_bytes(self) -> int:
        """Bytes the cached compiled grammars take (their serialized size)."""
        with self._lock:
            return self._cache.nbytes

    @property
    def num_pending(self) -> int:
        """Specs waiting for a slot or compiling."""
        with self._lock:
            return len(self._cache.pending())

    @property
    def worker_pids(self) -> list[int]:
        """The live worker processes (none in thread mode)."""
        return [e.pid for e in list(self._executors) if e.pid is not None]

    def shutdown(self) -> None:
        """Kill the worker processes and fail what is still waiting. Idempotent."""
        with self._lock:
            self._closed = True
            waiting = [future for _, _, _, future in self._queue] + self._cache.pending()
            self._queue.clear()
            self._lock.notify_all()
        for future in waiting:
            _settle(future, GrammarUnavailable("the grammar compiler was shut down", "grammar"))
        self._finalizer()

    # -- slots --------------------------------------------------------------------------
    def _start_slot(self, spare: bool) -> None:
        name = "switchyard-grammar-spare" if spare else "switchyard-grammar"
        threading.Thread(target=self._serve_slot, args=(spare,), name=name, daemon=True).start()

    def _serve_slot(self, spare: bool) -> None:
        """One slot: its executor, built on its first spec (the spare's at once, and started)."""
        executor = None
        if spare:
            executor = self._warm_executor()
        while True:
            taken = self._take(spare)
            if taken is None:
                return
            spec, future = taken
            try:
                executor = executor or self._new_executor()
            except BaseException as exc:  # noqa: BLE001 - handed to every request that asks
                self._finish(spec, future, GrammarUnavailable(f"the grammar compiler could not start: {exc}",
                                                              param_of(spec)))
                continue
            self._finish(spec, future, self._run(executor, spec))
            executor.prestart()  # a worker killed at its time limit is replaced while idle

    def _take(self, spare: bool) -> tuple[GrammarSpec, Future] | None:
        """The next spec this slot may compile (smallest first; the spare's only small ones),
        or None once shut down."""
        with self._lock:
            while True:
                while not self._closed and not (self._queue and (
                        not spare or self._queue[0][0] <= self.config.spare_max_spec_bytes)):
                    self._lock.wait()
                if self._closed:
                    return None
                _, _, spec, future = heapq.heappop(self._queue)
                if not future.done() and future.set_running_or_notify_cancel():
                    return spec, future

    def _warm_executor(self):
        """The spare's executor with its worker started, or None (its first spec retries)."""
        try:
            executor = self._new_executor()
        except BaseException:  # noqa: BLE001 - the first spec it takes reports it
            logger.warning("the spare grammar compile worker did not start", exc_info=True)
            return None
        executor.prestart()
        return executor

    def _new_executor(self):
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
        compiler = self._compiler
        if compiler.portable and self.config.use_processes:
            executor = ProcessExecutor(compiler, self.config, self.cpus)
        else:
            executor = ThreadExecutor(compiler)
        with self._lock:
            if self._closed:
                raise RuntimeError("shut down")
            self._executors.append(executor)
        return executor

    def _run(self, executor, spec: GrammarSpec) -> CompiledGrammar | GrammarError:
        timeout_s = self.config.compile_timeout_s
        try:
            check_finite(spec)
            compiled = executor.run(spec, timeout_s)
        except GrammarError as exc:
            return exc
        except WorkerStartError as exc:
            return GrammarUnavailable(f"the grammar compiler could not start: {exc}", param_of(spec))
        except CompileTimeout as timeout:
            with self._lock:
                self.num_timeouts += 1
            error = timeout_error(spec, timeout_s, timeout.cpu_s)
            logger.warning("grammar compile killed after %.3g s (%s, %d bytes, %s s of CPU): %s", timeout_s,
                           spec.kind, len(spec.value), "?" if timeout.cpu_s is None else f"{timeout.cpu_s:.3g}",
                           "the server's" if isinstance(error, GrammarUnavailable) else "the schema's")
            return error
        try:
            check_size(spec, compiled.nbytes, self.config.largest_grammar_bytes)  # in thread mode; a worker checks before sending
        except GrammarError as exc:
            return exc
        return compiled

    def _finish(self, spec: GrammarSpec, future: Future, result) -> None:
        with self._lock:
            if isinstance(result, (_TimedOut, GrammarUnavailable)):  # never cached: a retry compiles afresh
                self._cache.drop(spec, future)
            _settle(future, result)
            if not isinstance(result, BaseException):
                self._cache.resolved(spec, future, result.nbytes)


# A compile that had at least this share of one core for its whole time limit, and still did not
# finish, is too heavy (the schema's fault); with less, the engine's steps and other compiles took
# the CPU before the niced worker could (the server's). Half a core leaves room for a second worker
# sharing the core, and for the CPU clock's coarse ticks.
SCHEMA_CPU_SHARE = 0.5


def timeout_error(spec: GrammarSpec, timeout_s: float, cpu_s: float | None) -> GrammarError:
    """What a compile killed at its time limit fails with, decided here only: the schema's
    GrammarError (a 400/422) if it had `SCHEMA_CPU_SHARE` of a core all that time (or its CPU
    time is unknown), else the server's GrammarUnavailable (a 503 with Retry-After)."""
    took = f"compiling the grammar took longer than {timeout_s:g} s"
    if cpu_s is not None and cpu_s < SCHEMA_CPU_SHARE * timeout_s:
        return _Starved(f"{took}, this server being too busy to give it the CPU (it had {cpu_s:.2g} s of it); "
                        f"retry later", param_of(spec))
    return _TimedOut(took, param_of(spec))


class _TimedOut(GrammarError):
    """A compile too heavy for the time limit: failed, and not cached."""


class _Starved(GrammarUnavailable):
    """A compile the busy server starved past the time limit: unavailable, and not cached."""


def _settle(future: Future, result) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _failed(error: GrammarError) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def _what(spec: GrammarSpec) -> str:
    return {"regex": "regular expression", "structural": "tool-call grammar"}.get(spec.kind, "JSON schema")


def _close_all(executors: list) -> None:
    for executor in executors:
        executor.shutdown()
