"""Servers of the reliability suite (imported by its test modules; tests/ has no
packages): a real uvicorn server run as `switchyard serve` runs it (DrainingServer) on
its own thread, and a random-weight toy Llama behind one, for load tests that measure
the gateway and the scheduler's accounting rather than a model's speed on a shared CPU."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from switchyard.core.engine.client import InProcessEngineClient
from switchyard.core.config import CacheConfig, EngineConfig, GrammarConfig, ModelConfig, SchedulerConfig
from switchyard.gateway.app import create_app
from switchyard.gateway.serve import DrainingServer
from switchyard.gateway.settings import ServerSettings

TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


def serve_draining(engine_client, grace_s: float = 2.0, **settings):
    """A real uvicorn server as `switchyard serve` runs it (DrainingServer), on its own thread."""
    app = create_app(ServerSettings(model_id="default", graceful_shutdown_s=grace_s, **settings), engine_client)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=grace_s)
    server = DrainingServer(config, app.state.drain)
    server.install_signal_handlers = lambda: None  # not the main thread: the test sends the "signal"
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@dataclass
class TinyServer:
    base_url: str
    app: object
    client: InProcessEngineClient

    def wait_idle(self, timeout: float = 60.0) -> None:
        pool = self.client.engine.scheduler.kv_cache_manager.block_pool
        deadline = time.monotonic() + timeout
        while self.client.engine.has_unfinished_requests() or pool.num_free_blocks != pool.num_usable_blocks:
            assert time.monotonic() < deadline, f"not idle: {pool.num_usable_blocks - pool.num_free_blocks} blocks"
            time.sleep(0.02)


def tiny_engine(grammar: GrammarConfig = GrammarConfig()):
    from switchyard.core.engine.core import EngineCore
    from switchyard.core.loader import load_tokenizer

    config = EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy"),
                          cache=CacheConfig(num_blocks=4096),
                          scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=256), grammar=grammar)
    tokenizer = load_tokenizer(config.model)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE  # the byte-level toy tokenizer has none
    return EngineCore(config, tokenizer=tokenizer), tokenizer


@contextlib.contextmanager
def start_tiny(grammar: GrammarConfig = GrammarConfig(), **settings):
    """A TinyServer with these ServerSettings fields (and grammar compiles), stopped on exit."""
    client = InProcessEngineClient(lambda: tiny_engine(grammar))
    client.start()
    asyncio.run(client.wait_ready(timeout=120))
    server, thread, url = serve_draining(client, **settings)
    try:
        yield TinyServer(url, server.config.app, client)
    finally:
        server.should_exit = True
        thread.join(10)
        asyncio.run(client.shutdown())
