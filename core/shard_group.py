"""Shard processes: the ShardLauncher of core/backend.py with spawned processes.

Each shard runs target(shard, *args) in a fresh (spawned) interpreter. It reports the
exception that ended it through a pipe, so its group can say "Shard 1 terminated:
RuntimeError: ..." as TGI's launcher does, and it exits when the process that started it
dies, however abruptly (a watch thread on multiprocessing's parent sentinel).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from .backend_contract import ShardInfo

logger = logging.getLogger(__name__)

EXIT_PARENT_DIED = 70


def _exit_with_parent() -> None:
    """In a shard: a daemon thread that ends the process once its parent has died."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(EXIT_PARENT_DIED)

    threading.Thread(target=watch, name="switchyard-parent-watch", daemon=True).start()


def _shard_main(shard: ShardInfo, target: Callable[..., None], args: tuple, errors: Connection) -> None:
    """A shard process's body: the standard rendezvous variables for libraries that read
    them, target, and the last error sent back to the launcher."""
    _exit_with_parent()
    os.environ.update(RANK=str(shard.rank), LOCAL_RANK=str(shard.local_rank), WORLD_SIZE=str(shard.world_size),
                      LOCAL_WORLD_SIZE=str(shard.local_world_size), MASTER_ADDR=shard.master_addr,
                      MASTER_PORT=str(shard.master_port))
    from .distributed import destroy_process_group

    try:
        target(shard, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then the process fails
        traceback.print_exc()
        errors.send(f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    destroy_process_group()
    # A clean end skips the interpreter's teardown of torch (seconds on a busy machine):
    # nothing is left to flush but the standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class _Shard:
    rank: int
    process: mp.process.BaseProcess
    errors: Connection
    last_error: str | None = None

    def describe_end(self) -> str:
        if self.errors is not None and not self.errors.closed and self.errors.poll():
            try:
                self.last_error = self.errors.recv()
            except (EOFError, OSError):
                pass
        code = self.process.exitcode
        if self.last_error is not None:
            how = self.last_error
        elif code is not None and code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        return f"Shard {self.rank} terminated: {how}"


class ProcessShardGroup:
    """The shards one launcher started (the ShardGroup protocol)."""

    def __init__(self, shards: list[_Shard]):
        self._shards = shards

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(s.process.pid for s in self._shards)

    def failure(self) -> str | None:
        """The first shard that ended with an error or a signal; a clean exit (code 0,
        its target returned) is not a failure."""
        for shard in self._shards:
            code = shard.process.exitcode
            if code is not None and code != 0:
                return shard.describe_end()
        return None

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for shard in self._shards:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            shard.process.join(left)
            if shard.process.exitcode is None:
                return False
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to every running shard, SIGKILL to those still running after timeout; reaps all."""
        for shard in self._shards:
            if shard.process.exitcode is None:
                shard.process.terminate()
        if not self.wait(timeout):
            for shard in self._shards:
                if shard.process.exitcode is None:
                    logger.warning("shard %d ignored SIGTERM for %.0fs; killing it", shard.rank, timeout)
                    shard.process.kill()
            self.wait()
        for shard in self._shards:
            shard.errors.close()


class ProcessShardLauncher:
    """One spawned process per ShardInfo running target(shard, *args); returns at once.
    target and args must be picklable (a module-level function, frozen configs).

    env_for(shard), when given, is set in each process's environment before its interpreter
    starts (PJRT and Neuron read which device is theirs before any of the child's code runs):
    the parent sets it around the spawn, under a lock, and restores its own."""

    def __init__(self, env_for: Callable[[ShardInfo], Mapping[str, str]] | None = None):
        self.env_for = env_for

    def start(self, shards: Sequence[ShardInfo], target: Callable[..., None], args: tuple = ()) -> ProcessShardGroup:
        context = mp.get_context("spawn")
        started: list[_Shard] = []
        for shard in shards:
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=_shard_main, args=(shard, target, tuple(args), writer),
                                      name=f"switchyard-shard-{shard.rank}")
            with _environment({} if self.env_for is None else self.env_for(shard)):
                process.start()
            writer.close()
            started.append(_Shard(shard.rank, process, reader))
        return ProcessShardGroup(started)


_ENV_LOCK = threading.Lock()  # os.environ is process-wide: one spawn at a time


@contextmanager
def _environment(extra: Mapping[str, str]):
    if not extra:
        yield
        return
    with _ENV_LOCK:
        saved = dict(os.environ)
        os.environ.update(extra)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)
