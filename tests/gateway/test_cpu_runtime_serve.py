"""`switchyard serve` on CPU starts its engine process tuned (backends/cpu/runtime.py: the
allocator and Intel OpenMP preloaded, threads set and bound), keeps a user's own settings,
and `--runtime plain` starts it as launched. The gateway process itself is never tuned."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_engine_process_serve import _engine_pid
from switchyard.core.testing.serving import free_port
from test_serve import _wait_healthy

from switchyard.backends.cpu.runtime import this_machine

TINY = ("--model", "llama-tiny", "--load-format", "dummy", "--max-batch-total-tokens", "512", "--dtype", "float32")


def _serve(*flags: str, **env: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.gateway.cli", "serve", "--port", str(port), *TINY, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    return proc, f"http://127.0.0.1:{port}"


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [entry.decode().partition("=") for entry in f.read().split(b"\0") if entry]
    return {name: value for name, _, value in pairs}


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.stdout.read()


@pytest.mark.slow  # two servers start: 112 s measured on a loaded 2-core machine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_engine_process_runs_tuned_and_plain_runs_as_launched():
    planned = this_machine()
    libraries = [lib for lib in (planned.allocator, planned.openmp) if lib is not None]
    tuned, tuned_url = _serve(OMP_NUM_THREADS="1")  # the user's own thread count is kept
    plain, plain_url = _serve("--runtime", "plain")
    try:
        _wait_healthy(tuned, tuned_url)
        _wait_healthy(plain, plain_url)
        engine, plain_engine = _engine_pid(tuned.pid), _engine_pid(plain.pid)
        env, maps = _environ(engine), _maps(engine)
        for library in libraries:  # preloaded: mapped into the engine process, not the gateway
            assert library.path in env["LD_PRELOAD"].split() and os.path.realpath(library.path) in maps
            assert os.path.realpath(library.path) not in _maps(tuned.pid)
        assert env["OMP_NUM_THREADS"] == "1"
        if planned.openmp is not None:
            assert env["KMP_BLOCKTIME"] == "1" and "KMP_AFFINITY" in env
        else:
            assert env["OMP_PROC_BIND"] == "close"
        plain_env, plain_maps = _environ(plain_engine), _maps(plain_engine)
        assert "OMP_NUM_THREADS" not in plain_env and "KMP_AFFINITY" not in plain_env
        for library in libraries:
            assert os.path.realpath(library.path) not in plain_maps
    finally:
        tuned_log, plain_log = _stop(tuned), _stop(plain)
    assert "cpu runtime: 1 torch threads" in tuned_log, tuned_log
    # "engine process environment: ..." or, predicted from an earlier start, "... (as at the last start): ..."
    assert "engine process environment" in tuned_log and "engine process environment" not in plain_log
