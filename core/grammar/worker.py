"""A grammar compile worker: a child process that compiles specs for one compiler.

Run as `python -m switchyard.core.grammar.worker FD NICE CPUS` by `ProcessExecutor`. The
parent sends the pickled compiler once, then one `GrammarSpec` at a time over the
socket FD; the worker answers ("ok", bytes of the compiled grammar) or ("error",
(message, param)). First it takes CPUS (e.g. "0,1") as its affinity, not the one core
of the engine thread that started it (placement.py), and lowers its own priority, so a
heavy compile takes only CPU the engine leaves idle, on any of its cores; it exits when
the socket closes or its parent goes away (no orphans, even if the parent is killed). A
compile that runs too long is ended by the parent killing the process: native compilers
cannot be interrupted.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from multiprocessing.connection import Connection


def _watch_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """Exit as soon as the parent is gone (we are then re-parented)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(conn: Connection) -> None:
    from .base import check_size, param_of
    from .spec import GrammarError

    compiler, max_bytes = pickle.loads(conn.recv_bytes())  # noqa: S301 - sent by our parent
    conn.send(("ready", os.getpid()))
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compiled = compiler.compile(spec)
            check_size(spec, compiled.nbytes, max_bytes)  # before a long serialization
            data = compiler.dump(compiled)
            check_size(spec, len(data), max_bytes)
            answer = ("ok", data)
        except GrammarError as exc:
            answer = ("error", (str(exc), exc.param))
        except Exception as exc:  # noqa: BLE001 - a compiler bug fails this spec, not the worker
            answer = ("error", (f"the grammar could not be compiled: {exc}", param_of(spec)))
        conn.send(answer)


def main(argv: list[str]) -> None:
    from .placement import parse_cpus, release_binding

    fd, nice = int(argv[1]), int(argv[2])
    release_binding(parse_cpus(argv[3] if len(argv) > 3 else ""))  # before torch loads an OpenMP runtime
    _watch_parent(os.getppid())
    if nice:
        os.nice(nice)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    serve(Connection(fd))


if __name__ == "__main__":
    main(sys.argv)
