"""A `switchyard serve` process seen from a test or a benchmark: a loopback port for it, and a wait
until it answers /health."""
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
