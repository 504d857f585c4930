"""Shard processes: the ShardLauncher of core/backend.py with spawned processes.

Each shard runs target(shard, *args) in a fresh interpreter (`python -c`, started by
subprocess) whose whole environment is given to it at its start (`env=`): this process's, the
backend's variables for that shard (`env_for`: PJRT and Neuron read which device is theirs
before any of the child's code runs) and the standard rendezvous variables. This process's own
os.environ is only read, never written, so no other thread of the engine sees a shard's
variables. The child reads (sys.path, shard, target, args) pickled from its stdin.

A shard reports the exception that ended it through a pipe, so its group can say "Shard 1
terminated: RuntimeError: ..." as TGI's launcher does, and it exits when the process that
started it dies, however abruptly: the write end of its stdin stays open in the parent, and a
watch thread in the shard ends it when that pipe reaches end-of-file.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ..backend_contract import ShardInfo

logger = logging.getLogger(__name__)

EXIT_PARENT_DIED = 70
# A shard's interpreter: this module's _child_main, with the error pipe's descriptor as argv[1].
_CHILD_CODE = "from switchyard.core.shards.group import _child_main; _child_main()"
_LENGTH = struct.Struct("!Q")  # the pickled start's size, before it on the child's stdin


def rendezvous_environment(shard: ShardInfo) -> dict[str, str]:
    """The standard rendezvous variables (torchrun's), for libraries that read them."""
    return dict(RANK=str(shard.rank), LOCAL_RANK=str(shard.local_rank), WORLD_SIZE=str(shard.world_size),
                LOCAL_WORLD_SIZE=str(shard.local_world_size), MASTER_ADDR=shard.master_addr,
                MASTER_PORT=str(shard.master_port))


# -- in the shard process ----------------------------------------------------------------------
def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("the launcher closed the pipe before the shard's start was read")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _take_stdin() -> int:
    """The launcher's pipe (our stdin) moved to a descriptor of its own; stdin becomes
    /dev/null, as in a multiprocessing child."""
    lifeline = os.dup(0)  # not inheritable: the shard's own children do not keep it open
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the process's stdin for its whole life
    return lifeline


def _exit_with_parent(lifeline: int) -> None:
    """A daemon thread that ends this process once its parent has died: the parent never
    writes to the pipe again, so end-of-file means its write end was closed."""

    def watch() -> None:
        while True:
            try:
                if not os.read(lifeline, 4096):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os._exit(EXIT_PARENT_DIED)

    threading.Thread(target=watch, name="switchyard-parent-watch", daemon=True).start()


def _child_main() -> None:
    """A shard process's body: its start read from the launcher, the parent watched, target
    run, and the last error sent back to the launcher."""
    errors = Connection(int(sys.argv[1]), readable=False)
    os.set_inheritable(errors.fileno(), False)
    lifeline = _take_stdin()
    (size,) = _LENGTH.unpack(_read_exactly(lifeline, _LENGTH.size))
    path, start = pickle.loads(_read_exactly(lifeline, size))
    sys.path[:] = path  # before the start is unpickled: target's module is found as the parent found it
    _exit_with_parent(lifeline)
    try:
        shard, target, args = pickle.loads(start)  # imports target's module: its errors are reported too
        target(shard, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then the process fails
        traceback.print_exc()
        errors.send(f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    if "torch.distributed" in sys.modules:  # a target that joined a process group leaves it
        from .distributed import destroy_process_group

        destroy_process_group()
    # A clean end skips the interpreter's teardown of torch (seconds on a busy machine):
    # nothing is left to flush but the standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class _Shard:
    rank: int
    process: subprocess.Popen
    errors: Connection
    last_error: str | None = None

    def describe_end(self) -> str:
        if self.errors is not None and not self.errors.closed and self.errors.poll():
            try:
                self.last_error = self.errors.recv()
            except (EOFError, OSError):
                pass
        code = self.process.returncode
        if self.last_error is not None:
            how = self.last_error
        elif code is not None and code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        return f"Shard {self.rank} terminated: {how}"

    def close(self) -> None:
        """Its error pipe, and its stdin (the pipe that keeps it alive while we are)."""
        self.errors.close()
        try:
            self.process.stdin.close()
        except OSError:  # a start it never read: nothing to flush to a process that ended
            pass


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
            code = shard.process.poll()
            if code is not None and code != 0:
                return shard.describe_end()
        return None

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for shard in self._shards:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                shard.process.wait(left)
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to every running shard, SIGKILL to those still running after timeout; reaps all."""
        for shard in self._shards:
            if shard.process.poll() is None:
                shard.process.terminate()
        if not self.wait(timeout):
            for shard in self._shards:
                if shard.process.poll() is None:
                    logger.warning("shard %d ignored SIGTERM for %.0fs; killing it", shard.rank, timeout)
                    shard.process.kill()
            self.wait()
        for shard in self._shards:
            shard.close()


class ProcessShardLauncher:
    """One process per ShardInfo running target(shard, *args); returns at once. target and
    args must be picklable (a module-level function of an importable module, frozen configs).

    env_for(shard), when given, is in each process's environment from its start (PJRT and
    Neuron read which device is theirs before any of the child's code runs): the child is given
    its whole environment (`environment`), and this process's os.environ is left as it is."""

    def __init__(self, env_for: Callable[[ShardInfo], Mapping[str, str]] | None = None):
        self.env_for = env_for

    def environment(self, shard: ShardInfo) -> dict[str, str]:
        """A shard process's whole environment: this process's, then env_for(shard), then the
        rendezvous variables."""
        extra = {} if self.env_for is None else self.env_for(shard)
        return {**os.environ, **extra, **rendezvous_environment(shard)}

    def start(self, shards: Sequence[ShardInfo], target: Callable[..., None], args: tuple = ()) -> ProcessShardGroup:
        started: list[_Shard] = []
        try:
            for shard in shards:
                started.append(_spawn(shard, target, tuple(args), self.environment(shard)))
        except BaseException:
            ProcessShardGroup(started).stop()
            raise
        return ProcessShardGroup(started)


def _spawn(shard: ShardInfo, target: Callable[..., None], args: tuple, env: Mapping[str, str]) -> _Shard:
    """One shard process with exactly `env`; its start (sys.path first, so that the child can
    import target's module before unpickling it) goes down its stdin."""
    start = pickle.dumps((list(sys.path), pickle.dumps((shard, target, args))))  # unpicklable: fails here
    reader, writer = os.pipe()  # the shard's last error
    try:
        process = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, str(writer)], env=dict(env),
                                   stdin=subprocess.PIPE, pass_fds=(writer,))
    except BaseException:
        os.close(reader)
        raise
    finally:
        os.close(writer)  # the child's copy is its own: our reader sees EOF when it ends
    try:
        process.stdin.write(_LENGTH.pack(len(start)) + start)
        process.stdin.flush()
    except BrokenPipeError:  # it ended before reading its start: its exit code says how
        pass
    return _Shard(shard.rank, process, Connection(reader, writable=False))
