"""Errors that cross the engine's process boundary (no torch here)."""
from __future__ import annotations


class ValidationError(ValueError):
    """Bad request parameters; the gateway renders it as a 4xx naming `param`. Defined here,
    beside the other errors, so that what raises it (core/params.py, core/grammar/spec.py)
    need not import each other."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine cannot serve: its step failed, its process or a shard ended. Requests in
    flight are failed with this error."""


class ShardTerminated(EngineDeadError):
    """A shard process ended while serving; fatal: the server reports 503 and exits."""


class BackendError(Exception):
    """A backend was asked for that is unknown, failed to load, or is not usable here.
    `switchyard` prints it as one line and exits 2 (a user error, not a crash)."""


class BackendCapabilityError(BackendError):
    """The chosen backend declares (Capabilities) that it cannot serve the configuration:
    a dtype or block size outside its lists."""
