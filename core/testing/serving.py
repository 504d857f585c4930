"""A `switchyard serve` process seen from a test or a benchmark: wait until it answers /health."""
from __future__ import annotations

import subprocess
import time


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
