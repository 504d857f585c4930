"""Where one compile runs: in a worker process that can be killed (portable compilers),
or in a thread of this process (compilers that cannot cross a process).

`run(spec, timeout_s)` returns the CompiledGrammar or raises GrammarError (GrammarUnavailable
if the worker ended under the compile, WorkerStartError if none started in time); past the
time limit it raises CompileTimeout, with the CPU time the compile got (the service tells a
schema too heavy from a machine too busy by it). A process executor then kills its worker
(the next compile starts a fresh one); a thread cannot be stopped, so the thread executor
leaves it to finish in the background and throws its result away. Neither result is ever
cached.

A worker process is started ahead (`prestart`) or on first use, on the CPUs it is given and
unbound (placement.py), and watched: one that ends while idle (killed, out of memory) is
replaced at once, so no request meets it, and one found gone when a compile is handed to it
(before its watcher saw it) is replaced there, the compile going to the fresh one: a request
never sees the broken pipe of a worker that died before it came.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Collection
from multiprocessing import Pipe

from ..config import GrammarConfig
from .base import CompiledGrammar, GrammarCompiler, param_of
from .placement import format_cpus, worker_environment
from .spec import GrammarError, GrammarSpec, GrammarUnavailable

logger = logging.getLogger(__name__)


# what a pipe raises once its worker is gone, or once shutdown() closed it from another thread
_CLOSED_UNDER_US = (EOFError, OSError, TypeError, ValueError)
# unexpected ends in a row (no compile answered between) after which a worker is no longer
# replaced ahead, only when a compile needs one: a worker that dies as soon as it starts must
# not be restarted for ever
MAX_ENDS_IN_A_ROW = 3


class CompileTimeout(Exception):
    """Past the time limit; `cpu_s`: the CPU seconds the compile got meanwhile (None: unknown)."""

    def __init__(self, cpu_s: float | None = None):
        super().__init__(cpu_s)
        self.cpu_s = cpu_s


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
        if not box:  # a fresh thread: all its CPU time is the compile's
            raise CompileTimeout(cpu_seconds(f"/proc/self/task/{thread.native_id}/stat"))
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
    """One worker process at a time, on `cpus`: started ahead or on first use, replaced after
    a kill, and watched by a thread while it lives."""

    def __init__(self, compiler: GrammarCompiler, config: GrammarConfig, cpus: Collection[int] = ()):
        self.compiler = compiler
        self.config = config
        self.cpus = frozenset(cpus)
        self._payload = pickle.dumps((compiler, config.largest_grammar_bytes))
        self._process: subprocess.Popen | None = None
        self._conn = None
        self._lock = threading.Lock()  # the handles: shutdown() and the watcher come from other threads
        self._start_lock = threading.Lock()  # one start at a time: a run's, prestart's or the watcher's
        self._shut = False
        self._ends_in_a_row = 0
        self.num_replaced = 0  # workers found ended while idle, and replaced

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None else None

    def run(self, spec: GrammarSpec, timeout_s: float) -> CompiledGrammar:
        # A worker that ends before it answers gets the spec once more, on a fresh worker: its end
        # may have raced the hand-over (a send into a pipe that another process still held open
        # succeeds), and a spec that kills its worker twice is the 503 below, not a loop.
        for attempt in range(2):
            process, conn, cpu_before = self._hand_over(spec)
            try:
                if not conn.poll(timeout_s):
                    cpu_now = cpu_seconds(f"/proc/{process.pid}/stat")
                    self._discard(process)
                    raise CompileTimeout(None if None in (cpu_now, cpu_before) else cpu_now - cpu_before)
                kind, payload = conn.recv()
                break
            except _CLOSED_UNDER_US as exc:  # killed under the compile (e.g. out of memory) or shut down
                self._discard(process)
                if attempt or self._shut:
                    raise GrammarUnavailable(f"the grammar compiler process ended unexpectedly ({exc or 'closed'})",
                                             param_of(spec)) from None
        with self._lock:
            self._ends_in_a_row = 0
        if kind == "error":
            raise GrammarError(*payload)
        return self.compiler.load(payload)

    def _hand_over(self, spec: GrammarSpec):
        """(process, its pipe, its CPU seconds) once `spec` is sent to a live worker. A worker
        that took no spec and yet is gone is replaced, and the spec sent to the fresh one."""
        for attempt in range(2):
            process, conn = self._live_worker()
            cpu_before = cpu_seconds(f"/proc/{process.pid}/stat")
            try:
                conn.send(spec)
                return process, conn, cpu_before
            except _CLOSED_UNDER_US as exc:  # it ended just now, before its watcher saw it
                self._discard(process)
                if attempt:
                    raise GrammarUnavailable(f"the grammar compiler process ended unexpectedly ({exc or 'closed'})",
                                             param_of(spec)) from None
        raise AssertionError("unreachable")

    def prestart(self) -> None:
        """Start the worker now if there is none alive (errors wait for the next run)."""
        try:
            self._live_worker()
        except WorkerStartError:
            pass

    def _live_worker(self):
        """(process, pipe) of the worker, started if there is none and replaced if it is gone."""
        with self._start_lock:
            with self._lock:
                process, conn = self._process, self._conn
            if process is not None and _alive(process, conn):
                return process, conn
            if process is not None:
                self._replaced(process)
            return self._start()

    def _start(self):
        parent, child = Pipe()
        with self._lock:
            if self._shut:
                raise WorkerStartError("the grammar compile service is shut down")
            self._process = process = subprocess.Popen(
                [sys.executable, "-m", "switchyard.core.grammar.worker", str(child.fileno()),
                 str(self.config.worker_nice), format_cpus(self.cpus)],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=worker_environment(os.environ))
            self._conn = parent
        child.close()
        try:
            parent.send_bytes(self._payload)
            if not parent.poll(self.config.worker_start_timeout_s):
                raise TimeoutError(f"no answer in {self.config.worker_start_timeout_s:g} s")
            parent.recv()
        except (*_CLOSED_UNDER_US, TimeoutError) as exc:
            self._discard(process)
            raise WorkerStartError(f"the grammar compile worker did not start: {exc}") from None
        threading.Thread(target=self._watch, args=(process,), name="switchyard-grammar-watch", daemon=True).start()
        logger.info("grammar compile worker %d started (%s)", process.pid, self.compiler.name)
        return process, parent

    def _watch(self, process: subprocess.Popen) -> None:
        """Waits for `process` to end; if it was not ended on purpose (a kill at the time
        limit, shutdown), a fresh worker replaces it now, not when a request needs one."""
        process.wait()
        with self._lock:
            if self._process is not process or self._shut:
                return
            self._ends_in_a_row += 1
            ahead = self._ends_in_a_row <= MAX_ENDS_IN_A_ROW
        self._replaced(process)
        if ahead:
            self.prestart()

    def _replaced(self, process: subprocess.Popen) -> None:
        """A worker found ended: logged, reaped and forgotten (once, whoever finds it)."""
        with self._lock:
            if self._process is not process:
                return
            conn, self._process, self._conn = self._conn, None, None
            self.num_replaced += 1
        process.poll()
        logger.warning("grammar compile worker %d ended (exit status %s); a fresh one replaces it",
                       process.pid, process.returncode)
        _kill(process, conn)

    def _discard(self, process: subprocess.Popen) -> None:
        """Kill and reap `process` if it is still the worker (the next run starts a fresh one)."""
        with self._lock:
            if self._process is not process:
                return
            conn, self._process, self._conn = self._conn, None, None
        _kill(process, conn)

    def shutdown(self) -> None:
        """Kill the worker for good: no run starts another."""
        with self._lock:
            self._shut = True
        self.close()

    def close(self) -> None:
        """Kill the worker (if any) and reap it; the next run starts a fresh one."""
        with self._lock:
            process, conn, self._process, self._conn = self._process, self._conn, None, None
        if process is not None:
            _kill(process, conn)


def _alive(process: subprocess.Popen, conn) -> bool:
    """An idle worker is alive while it runs and its pipe has nothing to read (it writes only
    to answer: an idle pipe that reads is one whose other end closed)."""
    try:
        return process.poll() is None and not conn.poll(0)
    except _CLOSED_UNDER_US:
        return False


def _kill(process: subprocess.Popen, conn) -> None:
    if conn is not None:
        conn.close()
    process.kill()
    process.wait()


def cpu_seconds(stat_path: str) -> float | None:
    """User + system CPU seconds of the process or thread whose /proc stat file this is
    (None where it cannot be read: not Linux, already reaped)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
