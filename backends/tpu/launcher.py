"""Starting shard processes with a per-shard environment (PJRT's multi-process start).

PJRT runs one process per device: each process learns which chip is its own, how the
processes are laid out and where they rendezvous from environment variables that must be
set before the runtime starts. The launcher therefore sets them in the parent around each
spawn (the child inherits them before any of its imports run), one set per ShardInfo,
from a pure function the backend supplies (tpu: env.py; neuron: NEURON_RT_VISIBLE_CORES).
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Mapping, Sequence

from switchyard.core.backend import ShardInfo

_ENV_LOCK = threading.Lock()  # os.environ is process-wide: one spawn at a time


def _shard_main(target: Callable[..., None], shard: ShardInfo, args: tuple) -> None:
    target(shard, *args)


class ProcessGroup:
    """The ShardGroup of processes started by EnvShardLauncher."""

    def __init__(self, processes: list[tuple[ShardInfo, multiprocessing.process.BaseProcess]]):
        self.processes = processes

    def failure(self) -> str | None:
        for shard, process in self.processes:
            if process.exitcode is not None:
                return f"shard rank {shard.rank} (pid {process.pid}) ended with exit code {process.exitcode}"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        for _, process in self.processes:
            if process.is_alive():
                process.terminate()
        for _, process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()


class EnvShardLauncher:
    """ShardLauncher whose every process starts with env_for(shard) in its environment."""

    def __init__(self, env_for: Callable[[ShardInfo], Mapping[str, str]]):
        self.env_for = env_for

    def start(self, shards: Sequence[ShardInfo], target: Callable[..., None], args: tuple = ()) -> ProcessGroup:
        context = multiprocessing.get_context("spawn")  # a fresh runtime per device
        started = []
        for shard in shards:
            process = context.Process(target=_shard_main, args=(target, shard, args), daemon=True)
            with _ENV_LOCK:
                saved = dict(os.environ)
                os.environ.update(self.env_for(shard))
                try:
                    process.start()
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
            started.append((shard, process))
        return ProcessGroup(started)
