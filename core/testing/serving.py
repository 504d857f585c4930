"""Servers seen from a test or a benchmark: a loopback port for one, a wait until a `switchyard serve`
process answers /health, an app served in a test's own event loop."""
from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (the kernel's pick), for a server the caller starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    """Until GET base/health is 200; AssertionError with the server's output when it exits first or
    the timeout passes (its stdout must be a pipe, or None)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else f"the server exited {proc.returncode}"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server never became healthy"
        time.sleep(0.3)


def serve_on_loop(app, loop, **config):
    """`app` served by uvicorn on 127.0.0.1 (a free port) in `loop`, an asyncio loop another thread
    runs, once it has started: (the uvicorn.Server, its base URL). Set server.should_exit to stop it.
    `config`: more uvicorn.Config options."""
    import asyncio

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                           **config))
    server.install_signal_handlers = lambda: None  # not the main thread
    asyncio.run_coroutine_threadsafe(server.serve(), loop)
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}"
