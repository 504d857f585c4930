"""Compiles grammars off the step loop: a bounded LRU cache keyed by spec, worker
threads, and a time limit that fails only the request that asked.

`compile(spec)` returns a concurrent.futures.Future at once: already resolved on a
cache hit, else resolved by a worker. A compile that runs past `compile_timeout_s`
fails its future with GrammarError; its worker is written off (a native compile cannot
be interrupted) and a fresh worker takes its place, so one slow grammar never holds up
the others. When the written-off compile does finish, its result replaces the timeout
in the cache, so a retry of the same spec then succeeds at once.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from ..config import GrammarConfig
from .base import CompiledGrammar, GrammarCompiler, param_of
from .spec import GrammarError, GrammarSpec

logger = logging.getLogger(__name__)


class _Worker:
    def __init__(self) -> None:
        self.written_off = False


class GrammarCompileService:
    """One per engine (and so per tokenizer). Thread-safe. `make_compiler` runs on the
    first worker, so building the tokenizer tables never holds up the caller either."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], config: GrammarConfig = GrammarConfig()):
        self.config = config
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # the cache and the worker count
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._num_workers = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_timeouts = 0

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the CompiledGrammar (or of a GrammarError)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self.num_hits += 1
                return future
            self.num_misses += 1
            future = Future()
            self._cache[spec] = future
            while len(self._cache) > max(1, self.config.cache_size):
                self._cache.popitem(last=False)
            if self._num_workers < max(1, self.config.num_compile_threads):
                self._start_worker()
        self._jobs.put((spec, future))
        return future

    def __contains__(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        for _ in range(self._num_workers):
            self._jobs.put(None)

    # -- workers ------------------------------------------------------------------------
    def _start_worker(self) -> None:  # under self._lock
        self._num_workers += 1
        threading.Thread(target=self._work, args=(_Worker(),), name="switchyard-grammar", daemon=True).start()

    def _work(self, worker: _Worker) -> None:
        while not worker.written_off:
            job = self._jobs.get()
            if job is None:
                return
            spec, future = job
            if future.done() or not future.set_running_or_notify_cancel():
                continue
            self._run(worker, spec, future)

    def _run(self, worker: _Worker, spec: GrammarSpec, future: Future) -> None:
        try:
            compiler = self._get_compiler()
        except BaseException as exc:  # noqa: BLE001 - handed to every request that asks
            future.set_exception(GrammarError(f"the grammar compiler could not start: {exc}", param_of(spec)))
            return
        timer = threading.Timer(self.config.compile_timeout_s, self._expire, (worker, spec, future))
        timer.daemon = True
        timer.start()
        try:
            result: CompiledGrammar | BaseException = compiler.compile(spec)
        except BaseException as exc:  # noqa: BLE001 - GrammarError, or a compiler bug: fail the request
            result = exc if isinstance(exc, GrammarError) else GrammarError(
                f"the grammar could not be compiled: {exc}", param_of(spec))
        timer.cancel()
        with self._lock:
            if not future.done():
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            elif not isinstance(result, BaseException) and self._cache.get(spec) is future:
                self._cache[spec] = _resolved(result)  # timed out, finished late: keep it for retries

    def _get_compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def _expire(self, worker: _Worker, spec: GrammarSpec, future: Future) -> None:
        with self._lock:
            if future.done():
                return
            self.num_timeouts += 1
            worker.written_off = True
            self._num_workers -= 1
            self._start_worker()
            future.set_exception(GrammarError(
                f"compiling the grammar took longer than {self.config.compile_timeout_s:g} s", param_of(spec)))
        logger.warning("grammar compile timed out after %.3g s (%s)", self.config.compile_timeout_s, spec.kind)


def _resolved(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
