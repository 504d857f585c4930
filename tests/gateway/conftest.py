"""A real server for the gateway tests: uvicorn on a free port, the default model,
driven over HTTP by the real client libraries.

One engine (the default model) is loaded once per session and shared by every
server; `start_server(**settings)` starts another uvicorn app (other limits, an API
key, ...) on the same engine and background event loop."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, replace

import httpx
import pytest

from switchyard.core.client import InProcessEngineClient
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.gateway.app import create_app
from switchyard.gateway.settings import ServerSettings

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_factory():
    from switchyard.core.engine import EngineCore
    from switchyard.core.loader import load_tokenizer

    # the GGUF dequantized (--quantize none): the tests compare answers token for token across
    # batches and prefix-cache hits, which the packed blocks' two kernels (int8 activations for a
    # few rows, a bf16 GEMM for many) do not promise
    config = EngineConfig(model=ModelConfig(quantize="none"), cache=CacheConfig(num_blocks=2048),
                          scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64))
    tokenizer = load_tokenizer(config.model)
    return EngineCore(config, tokenizer=tokenizer), tokenizer


@pytest.fixture(scope="session")
def engine_client():
    client = InProcessEngineClient(_engine_factory)
    client.start()
    deadline = time.monotonic() + 300
    while not client.ready:
        if client.startup_error is not None:
            raise client.startup_error
        assert time.monotonic() < deadline, "engine did not start"
        time.sleep(0.05)
    yield client
    asyncio.run(client.shutdown())


@pytest.fixture(scope="session")
def start_server(engine_client):
    """start_server(**ServerSettings fields) -> RunningServer (stopped at session end)."""
    import uvicorn

    loop_thread = _LoopThread()
    servers = []

    def start(**overrides) -> RunningServer:
        settings = replace(ServerSettings(model_id=MODEL_NAME), **overrides)
        app = create_app(settings, engine_client)
        port = _free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # not the main thread
        asyncio.run_coroutine_threadsafe(server.serve(), loop_thread.loop)
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        running = RunningServer(f"http://127.0.0.1:{port}", app, engine_client, server)
        servers.append(running)
        return running

    yield start
    for running in servers:
        running.uvicorn_server.should_exit = True
    time.sleep(0.3)


@pytest.fixture(scope="session")
def server(start_server) -> RunningServer:
    """The default server: default settings, no API key."""
    return start_server()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client
