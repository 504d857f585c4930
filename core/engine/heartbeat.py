"""A line every few seconds while a long start-up step runs (a kernel compile, a wait for
another process's compile, a GGUF conversion), so that a first start is never silent."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

EVERY_S = 5.0


class Heartbeat:
    """`with Heartbeat(say):` calls say(seconds so far) every `every_s` seconds (default EVERY_S)
    from a daemon thread until the block ends (not at all for a block that ends sooner)."""

    def __init__(self, say: Callable[[float], None], every_s: float | None = None):
        self._say = say
        self._every_s = EVERY_S if every_s is None else every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Heartbeat":
        began = time.monotonic()

        def beat() -> None:
            while not self._stop.wait(self._every_s):
                self._say(time.monotonic() - began)

        self._thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
