"""Where one compile runs: in a worker process that can be killed (portable compilers),
or in a thread of this process (compilers that cannot cross a process).

`run(spec, timeout_s)` returns the CompiledGrammar or raises GrammarError (GrammarUnavailable
if the worker ended under the compile, WorkerStartError if none started in time); past the
time limit it raises CompileTimeout. A process executor then kills its worker (the next
compile starts a fresh one); a thread cannot be stopped, so the thread executor leaves
it to finish in the background and throws its result away. Neither result is ever cached.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
from multiprocessing import Pipe

from ..config import GrammarConfig
from .base import CompiledGrammar, GrammarCompiler, param_of
from .spec import GrammarError, GrammarSpec, GrammarUnavailable

logger = logging.getLogger(__name__)


# what a pipe raises once its worker is gone, or once shutdown() closed it from another thread
_CLOSED_UNDER_US = (EOFError, OSError, TypeError, ValueError)


class CompileTimeout(Exception):
    pass


class WorkerStartError(RuntimeError):
    pass


class ThreadExecutor:
    pid = None  # no process of its own

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler

    def run(self, spec: GrammarSpec, timeout_s: float) -> CompiledGrammar:
        box: list = []
        thread = threading.Thread(target=lambda: box.append(_compile_here(self.compiler, spec)),
                                  name="switchyard-grammar-compile", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not box:
            raise CompileTimeout
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def prestart(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _compile_here(compiler: GrammarCompiler, spec: GrammarSpec):
    try:
        return compiler.compile(spec)
    except GrammarError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - a compiler bug fails the request
        return GrammarError(f"the grammar could not be compiled: {exc}", param_of(spec))


class ProcessExecutor:
    """One worker process, started on first use and after a kill."""

    def __init__(self, compiler: GrammarCompiler, config: GrammarConfig):
        self.compiler = compiler
        self.config = config
        self._payload = pickle.dumps((compiler, config.largest_grammar_bytes))
        self._process: subprocess.Popen | None = None
        self._conn = None
        self._lock = threading.Lock()  # the process handle: shutdown() may come from another thread
        self._shut = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def run(self, spec: GrammarSpec, timeout_s: float) -> CompiledGrammar:
        conn = self._conn if self._process is not None else self._start()
        try:
            conn.send(spec)
            if not conn.poll(timeout_s):
                self.close()
                raise CompileTimeout
            kind, payload = conn.recv()
        except _CLOSED_UNDER_US as exc:  # killed (e.g. out of memory) or shut down: the server's failure
            self.close()
            raise GrammarUnavailable(f"the grammar compiler process ended unexpectedly ({exc or 'closed'})",
                                     param_of(spec)) from None
        if kind == "error":
            raise GrammarError(*payload)
        return self.compiler.load(payload)

    def prestart(self) -> None:
        """Start the worker now if there is none (errors wait for the next run)."""
        if self._process is None:
            try:
                self._start()
            except WorkerStartError:
                pass

    def _start(self):
        parent, child = Pipe()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with self._lock:
            if self._shut:
                raise WorkerStartError("the grammar compile service is shut down")
            self._process = subprocess.Popen(
                [sys.executable, "-m", "switchyard.core.grammar.worker", str(child.fileno()),
                 str(self.config.worker_nice)],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env)
            self._conn = parent
        child.close()
        try:
            parent.send_bytes(self._payload)
            if not parent.poll(self.config.worker_start_timeout_s):
                raise TimeoutError(f"no answer in {self.config.worker_start_timeout_s:g} s")
            parent.recv()
        except (*_CLOSED_UNDER_US, TimeoutError) as exc:
            self.close()
            raise WorkerStartError(f"the grammar compile worker did not start: {exc}") from None
        logger.info("grammar compile worker %d started (%s)", self._process.pid, self.compiler.name)
        return parent

    def shutdown(self) -> None:
        """Kill the worker for good: no run starts another."""
        with self._lock:
            self._shut = True
        self.close()

    def close(self) -> None:
        """Kill the worker (if any) and reap it; the next run starts a fresh one."""
        with self._lock:
            process, conn, self._process, self._conn = self._process, self._conn, None, None
        if conn is not None:
            conn.close()
        if process is not None:
            process.kill()
            process.wait()
