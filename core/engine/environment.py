"""The engine process's environment, known before torch is imported.

A backend's process environment (Backend.process_environment: a preloaded allocator and
OpenMP runtime, thread settings) is asked of the backend, whose module imports torch; the
engine process then re-executes itself with it (core/engine/process.py), and imports torch
again. `EnvironmentPrediction` keeps the answer of the last start with the same
configuration, so a cached start re-executes at once, before any heavy import: one torch
import instead of two (seconds of every start on a small machine).

A prediction is only a guess. The re-executed process asks the backend as before (it imports
it anyway) and, where the answer differs (a library moved, the user set a thread variable),
stores the true one and re-executes once more with it: a stale prediction costs one extra
start, never a wrong environment."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

FORMAT_VERSION = 1
# What a process environment is derived from, besides the configuration: the variables a
# backend keeps or reads (allocators, OpenMP, device visibility) and the cores at hand.
_RELEVANT_PREFIXES = ("LD_", "OMP_", "KMP_", "MKL_", "GOMP_", "CUDA_", "HIP_", "ROCR_", "ZE_", "ONEAPI_",
                      "PJRT_", "XLA_", "TPU_", "NEURON_", "SWITCHYARD_", "MALLOC_", "TCMALLOC_")


class EnvironmentPrediction:
    """The environment the last engine start of this configuration ran with, in a small JSON
    file under the cache root, keyed by what that environment was derived from."""

    def __init__(self, config, cache_root: str, key: str | None = None):
        """`key`: the one a first stage computed (a re-executed process, whose environment is
        no longer the one it was derived from, is handed it); None computes it here."""
        self.key = key or _key(config)
        self._path = os.path.join(cache_root, "engine-environment", f"{self.key}.json")

    def load(self) -> dict[str, str] | None:
        """The predicted environment, or None when there is none (or it cannot be read)."""
        try:
            with open(self._path) as file:
                stored = json.load(file)
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or not all(isinstance(v, str) for v in stored.values()):
            return None
        return stored

    def store(self, environment: dict[str, str]) -> None:
        """Writes atomically (a rename), so a concurrent start reads the old or the new file; a
        cache that cannot be written only costs the next start its prediction."""
        if self.load() == environment:
            return
        try:
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=os.path.dirname(self._path), suffix=".tmp")
            with os.fdopen(fd, "w") as file:
                json.dump(environment, file, sort_keys=True)
            os.replace(temporary, self._path)
        except OSError:
            pass


def missing_from_process(environment: dict[str, str]) -> dict[str, str]:
    """What of `environment` this process was not started with."""
    return {name: value for name, value in environment.items() if os.environ.get(name) != value}


def _key(config) -> str:
    relevant = sorted((k, v) for k, v in os.environ.items() if k.startswith(_RELEVANT_PREFIXES))
    cores = sorted(config.parallel.cpus) if config.parallel.cpus is not None else sorted(os.sched_getaffinity(0))
    described = json.dumps([FORMAT_VERSION, sys.executable, sys.version, config.backend, config.runtime,
                            config.parallel.sharded, cores, os.cpu_count(), relevant], default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:20]
