"""/health follows the engine process itself (issue 38): once the engine process has ended,
/health (and /ping, TGI's GET /) is 503 at the next call, without waiting for the client's
reader thread to see the engine's pipe close. Here the reader is held back (as a reader busy
delivering a step, or starved of the GIL, is late) while the engine process is killed."""
from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
from fastapi.testclient import TestClient

from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig
from switchyard.core.engine.process import ProcessEngineClient
from switchyard.gateway.app import create_app
from switchyard.gateway.settings import ServerSettings

TINY = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy"), cache=CacheConfig(num_blocks=64))
PROBES = ("/health", "/ping", "/")


class _HeldReader:
    """The client's end of the engine's channel, whose recv waits until released: the client's
    reader thread, once inside it, sees nothing of the engine until then."""

    def __init__(self, channel):
        self.channel = channel
        self.inside = threading.Event()
        self.release = threading.Event()

    def recv(self, timeout):
        self.inside.set()
        self.release.wait()
        return self.channel.recv(timeout)

    def send(self, message):
        self.channel.send(message)

    def close(self, *args, **kwargs):
        return self.channel.close(*args, **kwargs)


@pytest.mark.slow  # an engine process starts
def test_health_is_503_as_soon_as_the_engine_process_has_ended():
    client = ProcessEngineClient(TINY)
    client.start()
    held = None
    try:
        asyncio.run(client.wait_ready(timeout=600))
        http = TestClient(create_app(ServerSettings(model_id="m"), client))  # no lifespan: it stays up
        assert [http.get(path).status_code for path in PROBES] == [200, 200, 200]
        held = _HeldReader(client._channel)
        client._channel = held
        assert held.inside.wait(60)  # the reader is past its last look at the real channel
        pid = client.process.pid
        os.kill(pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # until it has ended; not reaped here
        assert client.failure is None  # the reader has not seen it ...
        for path in PROBES:  # ... /health has
            answer = http.get(path)
            assert answer.status_code == 503, (path, answer.status_code)
            assert answer.json()["error_type"] == "healthcheck" and "retry-after" not in answer.headers
        held.release.set()
        assert "exit code -9" in str(asyncio.run(asyncio.wait_for(client.wait_failure(), 30)))
        assert http.get("/health").status_code == 503
    finally:
        if held is not None:
            held.release.set()
        asyncio.run(client.shutdown())
