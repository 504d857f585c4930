"""The engine in its own process: `switchyard serve`'s default.

`ProcessEngineClient` spawns one process (a fresh interpreter: the gateway process never
imports torch, and nothing of its threads is forked) that builds EngineCore from the
EngineConfig, warms it up and runs core/engine/loop.py's step loop; the two talk over a
multiprocessing pipe (core/engine/channel.py says why not ZeroMQ). The engine process
starts the backend's shard processes itself (ranks 1..N-1; rank 0 is its own model).

If the engine process ends for any reason (a crash, SIGKILL, a shard's ShardTerminated),
the client fails every stream in flight with EngineDeadError, stops being ready (/health:
503) and reports `failure`; the gateway then exits non-zero. The engine process ends when
told to stop, or by itself when the gateway's end of the pipe closes (the gateway died);
either way it calls engine.shutdown(), stopping its grammar workers and shards.

The backend's process environment (Backend.process_environment: a preloaded allocator and
OpenMP runtime, thread settings) takes effect only at a process start, and only the engine
process knows its backend. So right after it selects the backend, the engine process
re-executes itself (os.execve: the same pid, the same pipe to the gateway, nothing sent yet)
with that environment, its start-up arguments handed over in an inherited unlinked file.
It does so at most once: a re-executed process whose environment still differs logs it and
serves as it is. The gateway sees one engine process start."""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from collections.abc import Callable

from .client import ChannelEngineClient
from ..config import EngineConfig, default_cache_root
from .channel import Channel, PipeChannel
from .environment import EnvironmentPrediction, missing_from_process
from .priority import serve_in_foreground, start_in_background
from .messages import ModelChecked, StartupFailed, StepStats, portable

logger = logging.getLogger(__name__)


class ProcessEngineClient(ChannelEngineClient):
    """`log_setup`, if given, is a picklable callable the engine process runs first (the
    gateway's log format, so both processes log alike)."""

    def __init__(self, config: EngineConfig, on_step: Callable[[StepStats], None] | None = None,
                 warm_up: bool = True, log_setup: Callable[[], None] | None = None):
        super().__init__(on_step)
        self.config = config
        self._warm_up = warm_up
        self._log_setup = log_setup
        self.process: subprocess.Popen | None = None

    def _open(self) -> Channel:
        """`python -m switchyard.core.engine.process FD`: a fresh interpreter that imports
        only what the engine needs (not the caller's __main__, as multiprocessing's spawn
        would); its start-up arguments are the first message on the pipe."""
        mine, theirs = Pipe(duplex=True)
        self.process = subprocess.Popen([sys.executable, "-m", "switchyard.core.engine.process", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()  # the child's copy is its own: our recv sees EOF when it ends
        logger.info("engine process started (pid %d)", self.process.pid)
        channel = PipeChannel(mine)
        channel.send(_StartArgs(self.config, self._warm_up, self._log_setup))
        return channel

    def wait_model_checked(self, timeout: float | None = None) -> str:
        """Blocks until the engine process has found the model (before loading it): its
        description; raises the error (unknown model, unsupported architecture) instead."""
        if not self._model_checked.wait(timeout):
            raise TimeoutError("the engine process did not check the model in time")
        if self.model_description is None:
            raise self._failure
        return self.model_description

    def _ended(self, wait_s: float = 0.0) -> str | None:
        try:
            code = self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            return None
        return f"the engine process ended (exit code {code})"

    def _close(self, timeout: float) -> None:
        for stop in (None, self.process.terminate, self.process.kill):
            if stop is not None:
                logger.warning("the engine process did not stop in time; %s", stop.__name__)
                stop()
            try:
                self.process.wait(timeout if stop is None else 5)
                break
            except subprocess.TimeoutExpired:
                continue
        self._channel.close(timeout=1)


@dataclass(frozen=True)
class _StartArgs:
    config: EngineConfig
    warm_up: bool
    log_setup: Callable[[], None] | None


RESTARTED_FLAG = "--start-args-fd"  # argv[2] of a re-executed engine process; argv[3] is the fd, then the stage and prediction key


def main(argv: list[str]) -> None:
    """The engine process: build, warm up, serve until told to stop or the gateway is gone."""
    # Ctrl-C reaches the whole process group: the gateway drains, then stops us itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pipe_fd = int(argv[1])
    restarted = len(argv) > 3 and argv[2] == RESTARTED_FLAG
    channel = PipeChannel(Connection(pipe_fd))
    try:
        args = _read_start_args(int(argv[3])) if restarted else channel.recv(None)
        if args.log_setup is not None:
            args.log_setup()
        if args.config.parallel.cpus is not None and not restarted:  # kept by the re-exec below
            os.sched_setaffinity(0, args.config.parallel.cpus)
        idle = args.config.start_in_background or args.config.serve_in_background  # core/engine/priority.py
        if idle and not restarted:  # kept by the re-exec below, as the affinity
            start_in_background()
        _settle_environment(args, pipe_fd, argv[4:6] if restarted else None)
        from .loop import serve_engine

        if _check_model(channel, args.config):
            serve_engine(channel, lambda: build_engine(args.config), args.warm_up, args.config.tracing,
                         on_ready=serve_in_foreground if idle and not args.config.serve_in_background else None)
    except EOFError:
        pass  # the gateway went away before we started
    finally:
        channel.close()


_PREDICTED, _VERIFIED = "predicted", "verified"  # argv[4]: what the environment of a re-exec came from


def _settle_environment(args: _StartArgs, pipe_fd: int, handed: list[str] | None) -> None:
    """Re-executes this process (at most twice) until it runs in its backend's environment.
    A first start re-executes at once with the environment predicted from the last start of
    this configuration (core/engine/environment.py), before importing torch; the backend's
    own answer, asked afterwards, corrects a stale prediction with one more re-exec. With no
    prediction, the backend is asked first, as a first start must."""
    root = args.config.model.cache_dir or default_cache_root()
    # a re-exec's environment differs from its first stage's, so its key is handed over
    stage, key = (handed + [_VERIFIED, None])[:2] if handed is not None else (None, None)
    prediction = EnvironmentPrediction(args.config, root, key)
    wanted = None
    if stage is None:
        predicted = prediction.load()
        if predicted is None:
            stage, wanted = _VERIFIED, _wanted_environment(args.config)
            prediction.store(wanted)
        else:
            stage = _PREDICTED
        missing = missing_from_process(predicted if predicted is not None else wanted)
        if missing:
            _restart_with(missing, pipe_fd, args, stage, prediction.key)
    if wanted is None:
        wanted = _wanted_environment(args.config)
        prediction.store(wanted)
    missing = missing_from_process(wanted)
    if missing and stage == _PREDICTED:
        _restart_with(missing, pipe_fd, args, _VERIFIED, prediction.key)
    if missing:
        logger.warning("the engine process runs without %s: still not in effect after a restart",
                       ", ".join(f"{k}={v}" for k, v in missing.items()))


def _wanted_environment(config: EngineConfig) -> dict[str, str]:
    """Its backend's process environment ({} for a backend that asks for nothing, or one that
    cannot be selected: _check_model says why)."""
    from ..plugins import select_backend

    try:
        return select_backend(config.backend).process_environment(config)
    except Exception:  # noqa: BLE001 - reported by _check_model, as a start-up error
        return {}


def _restart_with(environment: dict[str, str], pipe_fd: int, args: _StartArgs, stage: str, key: str) -> None:
    """Replaces this process by a fresh engine process with `environment` added (never returns)."""
    logger.info("engine process environment%s: %s", " (as at the last start)" if stage == _PREDICTED else "",
                " ".join(f"{k}={v}" for k, v in sorted(environment.items())))
    start_args = tempfile.TemporaryFile()  # unlinked: gone once both processes close it
    pickle.dump(args, start_args)
    start_args.flush()
    start_args.seek(0)
    os.set_inheritable(start_args.fileno(), True)
    os.set_inheritable(pipe_fd, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "switchyard.core.engine.process", str(pipe_fd),
                               RESTARTED_FLAG, str(start_args.fileno()), stage, key], {**os.environ, **environment})


def _read_start_args(fd: int) -> _StartArgs:
    with os.fdopen(fd, "rb") as start_args:
        return pickle.load(start_args)


def _check_model(channel: PipeChannel, config: EngineConfig) -> bool:
    """An unknown or unsupported model, a backend that cannot serve the configuration (its
    declared dtypes and block sizes) or a draft model without the model's tokenizer is a user
    error before the server starts serving."""
    from ..loader import choose_model
    from ..plugins import check_backend

    try:
        check_backend(config)
        description = choose_model(config.model)[2].describe()
        if config.speculative.method == "draft" and config.speculative.enabled:
            from ..spec.draft import check_draft_model

            check_draft_model(config)  # a draft without the model's tokenizer
    except Exception as exc:  # noqa: BLE001 - the gateway raises it: a one-line error, exit 2
        channel.send(StartupFailed(portable(exc)))
        return False
    channel.send(ModelChecked(description))
    return True


def build_engine(config: EngineConfig) -> tuple[object, object]:
    """(EngineCore, tokenizer): one tokenizer, for detokenization (and grammar compiles when it is
    transformers'; a ServingTokenizer, core/loader's for a converted GGUF, leaves them their own)."""
    from .core import EngineCore
    from ..loader import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    return EngineCore(config, tokenizer=tokenizer), tokenizer


if __name__ == "__main__":
    main(sys.argv)
