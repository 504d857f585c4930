"""Errors that cross the engine's process boundary (no torch here)."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot serve: its step failed, its process or a shard ended. Requests in
    flight are failed with this error."""


class ShardTerminated(EngineDeadError):
    """A shard process ended while serving; fatal: the server reports 503 and exits."""
