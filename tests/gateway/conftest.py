"""A real server for the gateway tests: uvicorn on a free port, the default model,
driven over HTTP by the real client libraries.

One engine (the default model, served as `switchyard serve` serves it by default: the packed
GGUF, integer kernels, every step in C++) is loaded once per session and shared by every
server; `start_server(**settings)` starts another uvicorn app (other limits, an API key, ...)
on the same engine and background event loop, `start_server(client=...)` one on another engine."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, replace

import httpx
import pytest

from served_engine import MODEL_NAME, default_engine_config, start_engine, stop_engine
from switchyard.core.engine.client import InProcessEngineClient
from switchyard.gateway.app import create_app
from switchyard.gateway.settings import ServerSettings
from switchyard.core.testing.serving import serve_on_loop


@dataclass
class RunningServer:
    base_url: str
    app: object
    client: InProcessEngineClient
    uvicorn_server: object

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"

    def kv_blocks_in_use(self) -> int:
        pool = self.client.engine.scheduler.kv_cache_manager.block_pool
        return pool.num_usable_blocks - pool.num_free_blocks

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request and no KV block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.client.engine.has_unfinished_requests() and self.kv_blocks_in_use() == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle: {self.client.engine.scheduler.num_running} running, "
                             f"{self.kv_blocks_in_use()} blocks in use")


class _LoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="test-servers")
        self.thread.start()

    def run(self, coro, timeout=None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="session")
def engine_client():
    client = start_engine(default_engine_config())
    yield client
    stop_engine(client)


@pytest.fixture(scope="session")
def start_server(engine_client):
    """start_server(client=the default engine, **ServerSettings fields) -> RunningServer (stopped at
    session end)."""
    loop_thread = _LoopThread()
    servers = []

    def start(client=engine_client, **overrides) -> RunningServer:
        running = serve(loop_thread, client, replace(ServerSettings(model_id=MODEL_NAME), **overrides))
        servers.append(running)
        return running

    yield start
    for running in servers:
        running.uvicorn_server.should_exit = True
    time.sleep(0.3)


def serve(loop_thread: _LoopThread, client, settings: ServerSettings) -> RunningServer:
    """A uvicorn app of `settings` over `client`, started on a free port of `loop_thread`'s loop."""
    app = create_app(settings, client)
    server, url = serve_on_loop(app, loop_thread.loop, timeout_graceful_shutdown=2)
    return RunningServer(url, app, client, server)


@pytest.fixture(scope="session")
def server(start_server) -> RunningServer:
    """The default server: default settings, no API key."""
    return start_server()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client
