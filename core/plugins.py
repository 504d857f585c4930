"""Discovery, probing and selection of hardware backends.

Backends are classes registered under the entry-point group `switchyard.backends`
(see pyproject.toml) and loaded with stevedore. A third-party package adds a backend
by shipping such an entry point; nothing here changes. Loading one plugin may fail
(a missing vendor wheel, a syntax error): that plugin is reported as not usable with
the error as its reason, and the others are unaffected.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from stevedore import ExtensionManager

from .backend import SINGLE_SHARD, AttentionKernel, AttentionSpec, Backend, Capabilities, ProbeResult, ShardInfo
from .capabilities import check_capabilities
from .config import EngineConfig
from .errors import BackendError

GROUP = "switchyard.backends"


@dataclass(frozen=True)
class BackendReport:
    name: str
    priority: int
    usable: bool
    reason: str
    capabilities: Capabilities | None
    attention_impl: str


@dataclass(frozen=True)
class _Candidate:
    name: str
    cls: type[Backend] | None  # None when the entry point failed to load
    probe: ProbeResult


def _load_candidates() -> list[_Candidate]:
    failures: list[_Candidate] = []

    def on_failure(_manager, entry_point, error: BaseException) -> None:
        reason = f"failed to load {entry_point.value}: {type(error).__name__}: {error}"
        failures.append(_Candidate(entry_point.name, None, ProbeResult(False, reason)))

    manager = ExtensionManager(GROUP, invoke_on_load=False, on_load_failure_callback=on_failure)
    candidates = [_probe(ext.name, ext.plugin) for ext in manager]
    return sorted(candidates + failures, key=lambda c: (-_priority(c), c.name))


def _probe(name: str, plugin: object) -> _Candidate:
    if not (isinstance(plugin, type) and issubclass(plugin, Backend)):
        return _Candidate(name, None, ProbeResult(False, f"{plugin!r} is not a switchyard Backend subclass"))
    try:
        result = plugin.probe()
    except Exception as error:  # the contract says never raise; report it if one does
        result = ProbeResult(False, f"probe() raised {type(error).__name__}: {error}")
    return _Candidate(name, plugin, result)


def _priority(candidate: _Candidate) -> int:
    return candidate.cls.priority if candidate.cls is not None else -(10**9)


def _report(candidate: _Candidate) -> BackendReport:
    usable, reason = candidate.probe.usable, candidate.probe.reason
    capabilities = None
    impl = candidate.cls.planned_attention_impl if candidate.cls is not None else ""
    if usable:
        try:
            capabilities = candidate.cls().capabilities()
            impl = capabilities.attention_impl
        except Exception as error:
            usable, reason = False, f"capabilities() raised {type(error).__name__}: {error}"
    priority = candidate.cls.priority if candidate.cls is not None else 0
    return BackendReport(candidate.name, priority, usable, reason, capabilities, impl)


def discover_backends() -> list[BackendReport]:
    """Every registered backend, highest priority first, with whether it is usable here and why."""
    return [_report(c) for c in _load_candidates()]


def select_backend(name: str | None = None) -> Backend:
    """An instance of the named backend, or of the highest-priority usable one when name is None."""
    candidates = _load_candidates()
    if name is None:
        for candidate in candidates:
            if candidate.probe.usable:
                return candidate.cls()
        raise BackendError("no usable backend found: " + _summary(candidates))
    by_name = {c.name: c for c in candidates}
    if name not in by_name:
        known = ", ".join(sorted(by_name)) or "(none registered)"
        raise BackendError(f"unknown backend {name!r}; known backends: {known}")
    candidate = by_name[name]
    if not candidate.probe.usable:
        raise BackendError(f"backend {name!r} is not usable here: {candidate.probe.reason}")
    return candidate.cls()


def check_backend(config: EngineConfig) -> EngineConfig:
    """What an engine start would decide about the backend, without loading anything: the
    configured (or best usable) backend is selected and its capabilities checked
    (capabilities.py). Raises BackendError; `switchyard serve` calls it before it listens."""
    backend = select_backend(config.backend)
    return check_capabilities(backend.name, backend.capabilities(), config)


def _summary(candidates: list[_Candidate]) -> str:
    return "; ".join(f"{c.name}: {c.probe.reason}" for c in candidates) or "no backends registered"


class PendingBackend(Backend):
    """Base for a registered backend whose implementation arrives with a later issue.

    Subclasses implement probe() honestly and must report not usable; everything
    else raises NotImplementedError, so selecting one fails loudly instead of half-working.
    """

    def _pending(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"{self.name} backend: {what} arrives with its own issue")

    def capabilities(self) -> Capabilities:
        raise self._pending("capabilities()")

    @property
    def device(self) -> torch.device:
        raise self._pending("device")

    def init_device(self, shard: ShardInfo = SINGLE_SHARD) -> None:
        raise self._pending("init_device()")

    def available_memory_bytes(self) -> int:
        raise self._pending("available_memory_bytes()")

    def attention(self, spec: AttentionSpec) -> AttentionKernel:
        raise self._pending("attention()")

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, spec: AttentionSpec) -> list[torch.Tensor]:
        raise self._pending("allocate_kv_cache()")
