"""The engine process takes its backend's process environment (Backend.process_environment)
by re-executing itself once, with its start-up arguments handed over; a second mismatch is
logged and never loops. A later start re-executes on the environment predicted from the last
one, before asking (importing) its backend, and a stale prediction is corrected with one more
re-exec. The real thing, with the CPU backend: tests/gateway/test_cpu_runtime_serve.py."""
from __future__ import annotations

import logging
import os
from multiprocessing import Pipe

import pytest

from switchyard.core.engine import process as engine_process
from switchyard.core.config import EngineConfig
from switchyard.core.engine.channel import PipeChannel


class _AsksFor:
    name = "asks"

    def __init__(self, environment):
        self.environment = environment

    def process_environment(self, config):
        return dict(self.environment)


class _Execed(Exception):
    pass


@pytest.fixture
def asked(monkeypatch, tmp_path):
    """The backend asks for SWITCHYARD_TEST_ASKED=1 (each ask counted in asked.backend_asks);
    os.execve is recorded, not run; predictions are kept under tmp_path."""
    from switchyard.core import plugins

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    asks = []

    def select_backend(name):
        asks.append(name)
        return _AsksFor({"SWITCHYARD_TEST_ASKED": "1"})

    monkeypatch.setattr(plugins, "select_backend", select_backend)
    monkeypatch.delenv("SWITCHYARD_TEST_ASKED", raising=False)
    calls = _Calls()

    def execve(path, argv, env):  # the fds the new process reads must survive the exec
        start_args = engine_process._read_start_args(os.dup(int(argv[5])))  # what the new process reads
        calls.append((argv, env, os.get_inheritable(int(argv[3])), os.get_inheritable(int(argv[5])), start_args))
        raise _Execed

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(engine_process, "_check_model", lambda channel, config: False)
    calls.backend_asks = asks
    return calls


class _Calls(list):
    """The recorded execs, and the names the backend was selected by (each an ask of its environment)."""

    backend_asks: list


def _start_args_sent(config: EngineConfig):
    mine, theirs = Pipe(duplex=True)
    channel = PipeChannel(mine)
    channel.send(engine_process._StartArgs(config, False, None))
    return channel, theirs


def _missing(config):
    return engine_process.missing_from_process(engine_process._wanted_environment(config))


def test_missing_environment_is_what_the_backend_asks_and_the_process_lacks(asked, monkeypatch):
    assert _missing(EngineConfig()) == {"SWITCHYARD_TEST_ASKED": "1"}
    monkeypatch.setenv("SWITCHYARD_TEST_ASKED", "1")
    assert _missing(EngineConfig()) == {}


def test_a_backend_that_cannot_be_selected_asks_nothing(monkeypatch):
    from switchyard.core import plugins

    def fail(name):
        raise RuntimeError("no such backend")

    monkeypatch.setattr(plugins, "select_backend", fail)
    assert _missing(EngineConfig(backend="nope")) == {}


def test_the_engine_process_re_executes_itself_with_the_environment_and_its_start_args(asked):
    config = EngineConfig(backend="asks")
    channel, theirs = _start_args_sent(config)
    pipe_fd = os.dup(theirs.fileno())  # main closes its channel's fd
    with pytest.raises(_Execed):
        engine_process.main(["engine_process", str(pipe_fd)])
    (argv, env, pipe_inherited, args_inherited, start_args), = asked
    assert argv[1:5] == ["-m", "switchyard.core.engine.process", str(pipe_fd), engine_process.RESTARTED_FLAG]
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


def _re_executed(config: EngineConfig, tmp_path, stage: str) -> list[str]:
    """main's argv as a re-exec at `stage` hands it over (its start args in a file, and the
    prediction key of its first stage, computed before the test changes the environment)."""
    import pickle

    from switchyard.core.config import default_cache_root
    from switchyard.core.engine.environment import EnvironmentPrediction

    args_file = tmp_path / f"args-{stage}"
    args_file.write_bytes(pickle.dumps(engine_process._StartArgs(config, False, None)))
    mine, theirs = Pipe(duplex=True)
    _re_executed.keep = mine  # the gateway's end stays open while main runs
    return ["engine_process", str(os.dup(theirs.fileno())), engine_process.RESTARTED_FLAG,
            str(os.open(args_file, os.O_RDONLY)), stage, EnvironmentPrediction(config, default_cache_root()).key]


def test_a_first_start_asks_the_backend_and_keeps_its_answer_as_the_next_prediction(asked):
    from switchyard.core.config import default_cache_root
    from switchyard.core.engine.environment import EnvironmentPrediction

    config = EngineConfig(backend="asks")
    channel, theirs = _start_args_sent(config)
    with pytest.raises(_Execed):
        engine_process.main(["engine_process", str(os.dup(theirs.fileno()))])
    (argv, env, *_), = asked
    assert argv[6] == "verified" and asked.backend_asks == ["asks"]
    assert EnvironmentPrediction(config, default_cache_root()).load() == {"SWITCHYARD_TEST_ASKED": "1"}
    channel.close()


def test_a_cached_start_re_executes_on_the_prediction_before_asking_the_backend(asked):
    """The point of the prediction: the first stage imports no backend (so not torch)."""
    from switchyard.core.config import default_cache_root
    from switchyard.core.engine.environment import EnvironmentPrediction

    config = EngineConfig(backend="asks")
    EnvironmentPrediction(config, default_cache_root()).store({"SWITCHYARD_TEST_ASKED": "1"})
    channel, theirs = _start_args_sent(config)
    with pytest.raises(_Execed):
        engine_process.main(["engine_process", str(os.dup(theirs.fileno()))])
    (argv, env, *_), = asked
    assert asked.backend_asks == [] and argv[6] == "predicted" and env["SWITCHYARD_TEST_ASKED"] == "1"
    channel.close()


def test_a_correct_prediction_is_verified_with_no_second_re_exec(asked, monkeypatch, tmp_path):
    config = EngineConfig(backend="asks")
    argv = _re_executed(config, tmp_path, "predicted")
    monkeypatch.setenv("SWITCHYARD_TEST_ASKED", "1")  # as the predicted re-exec started it
    engine_process.main(argv)
    assert asked == [] and asked.backend_asks == ["asks"]


def test_a_stale_prediction_is_corrected_by_one_more_re_exec_and_replaced(asked, monkeypatch, tmp_path):
    from switchyard.core.config import default_cache_root
    from switchyard.core.engine.environment import EnvironmentPrediction

    config = EngineConfig(backend="asks")
    prediction = EnvironmentPrediction(config, default_cache_root())
    prediction.store({"SWITCHYARD_TEST_ASKED": "0"})
    argv = _re_executed(config, tmp_path, "predicted")
    monkeypatch.setenv("SWITCHYARD_TEST_ASKED", "0")  # what the stale prediction started it with
    with pytest.raises(_Execed):
        engine_process.main(argv)
    (argv, env, *_), = asked
    assert argv[6] == "verified" and env["SWITCHYARD_TEST_ASKED"] == "1"
    assert prediction.load() == {"SWITCHYARD_TEST_ASKED": "1"}


def test_an_unreadable_prediction_is_no_prediction(tmp_path):
    from switchyard.core.engine.environment import EnvironmentPrediction

    prediction = EnvironmentPrediction(EngineConfig(), str(tmp_path))
    assert prediction.load() is None
    prediction.store({"A": "1"})
    (path,) = (tmp_path / "engine-environment").iterdir()
    path.write_text("{not json")
    assert prediction.load() is None
    path.write_text('{"A": 1}')
    assert prediction.load() is None
    assert EnvironmentPrediction(EngineConfig(runtime="plain"), str(tmp_path)).load() is None  # another key
