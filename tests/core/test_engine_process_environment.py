"""The engine process takes its backend's process environment (Backend.process_environment)
by re-executing itself once, with its start-up arguments handed over; a second mismatch is
logged and never loops. The real thing, with the CPU backend: tests/gateway/test_cpu_runtime_serve.py."""
from __future__ import annotations

import logging
import os
from multiprocessing import Pipe

import pytest

from switchyard.core import engine_process
from switchyard.core.config import EngineConfig
from switchyard.core.engine_channel import PipeChannel


class _AsksFor:
    name = "asks"

    def __init__(self, environment):
        self.environment = environment

    def process_environment(self, config):
        return dict(self.environment)


class _Execed(Exception):
    pass


@pytest.fixture
def asked(monkeypatch):
    """The backend asks for SWITCHYARD_TEST_ASKED=1; os.execve is recorded, not run."""
    from switchyard.core import plugins

    monkeypatch.setattr(plugins, "select_backend", lambda name: _AsksFor({"SWITCHYARD_TEST_ASKED": "1"}))
    monkeypatch.delenv("SWITCHYARD_TEST_ASKED", raising=False)
    calls = []

    def execve(path, argv, env):  # the fds the new process reads must survive the exec
        start_args = engine_process._read_start_args(os.dup(int(argv[5])))  # what the new process reads
        calls.append((argv, env, os.get_inheritable(int(argv[3])), os.get_inheritable(int(argv[5])), start_args))
        raise _Execed

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(engine_process, "_check_model", lambda channel, config: False)
    return calls


def _start_args_sent(config: EngineConfig):
    mine, theirs = Pipe(duplex=True)
    channel = PipeChannel(mine)
    channel.send(engine_process._StartArgs(config, False, None))
    return channel, theirs


def test_missing_environment_is_what_the_backend_asks_and_the_process_lacks(asked, monkeypatch):
    assert engine_process._missing_environment(EngineConfig()) == {"SWITCHYARD_TEST_ASKED": "1"}
    monkeypatch.setenv("SWITCHYARD_TEST_ASKED", "1")
    assert engine_process._missing_environment(EngineConfig()) == {}


def test_a_backend_that_cannot_be_selected_asks_nothing(monkeypatch):
    from switchyard.core import plugins

    def fail(name):
        raise RuntimeError("no such backend")

    monkeypatch.setattr(plugins, "select_backend", fail)
    assert engine_process._missing_environment(EngineConfig(backend="nope")) == {}


def test_the_engine_process_re_executes_itself_with_the_environment_and_its_start_args(asked):
    config = EngineConfig(backend="asks")
    channel, theirs = _start_args_sent(config)
    pipe_fd = os.dup(theirs.fileno())  # main closes its channel's fd
    with pytest.raises(_Execed):
        engine_process.main(["engine_process", str(pipe_fd)])
    (argv, env, pipe_inherited, args_inherited, start_args), = asked
    assert argv[1:5] == ["-m", "switchyard.core.engine_process", str(pipe_fd), engine_process.RESTARTED_FLAG]
    assert env["SWITCHYARD_TEST_ASKED"] == "1" and env["PATH"] == os.environ["PATH"]
    assert pipe_inherited and args_inherited
    assert start_args.config == config
    channel.close()


def test_a_re_executed_process_still_missing_it_logs_and_goes_on(asked, caplog, tmp_path):
    import pickle

    config = EngineConfig(backend="asks")
    args_file = tmp_path / "args"
    args_file.write_bytes(pickle.dumps(engine_process._StartArgs(config, False, None)))
    fd = os.open(args_file, os.O_RDONLY)
    mine, theirs = Pipe(duplex=True)
    with caplog.at_level(logging.WARNING):
        engine_process.main(["engine_process", str(os.dup(theirs.fileno())), engine_process.RESTARTED_FLAG, str(fd)])
    assert asked == []  # no second restart
    assert "runs without SWITCHYARD_TEST_ASKED=1: still not in effect after a restart" in caplog.text
    mine.close()
