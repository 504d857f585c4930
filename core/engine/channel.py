"""The two ends of the link between the engine's owner and its loop.

One interface, two transports: `queue_pair()` for an engine in a thread of this process
(nothing is pickled), `PipeChannel` for an engine in its own process.

Why multiprocessing pipes and not ZeroMQ: the engine process is always a child of the
gateway on the same machine, with exactly one peer; a `multiprocessing` pipe carries
pickled messages (our frozen dataclasses, exceptions included) with no new dependency,
its end-of-file tells each side at once that the other process is gone (no heartbeat
protocol), and it is inherited by the spawned child with no port or socket path to
choose. ZeroMQ's strengths (many peers, brokers, reconnection) are not needed here."""
from __future__ import annotations

import logging
import queue
import threading
from multiprocessing.connection import Connection
from typing import Protocol

logger = logging.getLogger(__name__)
_CLOSED = object()


class Channel(Protocol):
    def send(self, message) -> None:
        """Queue a message for the peer; never waits on the peer (thread-safe)."""

    def recv(self, timeout: float | None) -> object | None:
        """The next message, or None after `timeout` seconds; raises EOFError once the
        peer is gone (its process ended, or it closed its end)."""

    def close(self) -> None: ...


class QueueChannel:
    """One end of an in-process link: `send` into the peer's inbox, `recv` from ours."""

    def __init__(self, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue):
        self._inbox = inbox
        self._outbox = outbox

    def send(self, message) -> None:
        self._outbox.put(message)

    def recv(self, timeout: float | None) -> object | None:
        try:
            message = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if message is _CLOSED:
            self._inbox.put(_CLOSED)  # every later recv sees it too
            raise EOFError("the peer closed the channel")
        return message

    def close(self) -> None:
        self._outbox.put(_CLOSED)


def queue_pair() -> tuple[QueueChannel, QueueChannel]:
    """(owner's end, engine's end)."""
    to_engine: queue.SimpleQueue = queue.SimpleQueue()
    to_owner: queue.SimpleQueue = queue.SimpleQueue()
    return QueueChannel(to_owner, to_engine), QueueChannel(to_engine, to_owner)


class PipeChannel:
    """One end of a multiprocessing pipe. Messages are pickled and written by a writer
    thread, so a sender (the gateway's event loop, the engine's step loop) never waits for
    the peer to read; `recv` is called from one thread only."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="switchyard-pipe-writer", daemon=True)
        self._writer.start()

    def send(self, message) -> None:
        self._pending.put(message)

    def recv(self, timeout: float | None) -> object | None:
        try:
            if not self._conn.poll(timeout):
                return None
            return self._conn.recv()
        except (OSError, ValueError) as exc:  # closed under us
            raise EOFError(str(exc)) from exc

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then close (the peer's recv then raises EOFError)."""
        self._pending.put(_CLOSED)
        self._writer.join(timeout)
        self._conn.close()

    def _write(self) -> None:
        while True:
            message = self._pending.get()
            if message is _CLOSED:
                return
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the peer is gone: its recv side reports it
                return
            except Exception:  # noqa: BLE001 - a message that does not pickle: a bug, said loudly
                logger.exception("could not send %s to the peer", type(message).__name__)
