"""Where grammar compile workers run: which CPUs, and with no thread binding.

A CPU engine binds each OpenMP thread to one core (backends/cpu/runtime.py), its main thread
too, and a thread or process started after that inherits the one-core mask. So neither the
default number of workers nor a worker's affinity may come from `os.sched_getaffinity(0)` in
the engine: both come from `worker_cpus`, the CPUs the engine was given (ParallelConfig.cpus,
a data-parallel replica's or a model's `cpus`) or else those the machine and this process's
cgroup offer (the cpuset's effective CPUs among the online ones). A worker takes them as its
affinity first thing (`release_binding`), and starts without the engine's binding variables
(`worker_environment`): Intel OpenMP would otherwise bind its one thread again, or warn
(`OMP: Warning #124`) about cores of the engine's list outside the mask it inherited.
Torch-free; nothing is read at import.
"""
from __future__ import annotations

import os
from collections.abc import Collection, Mapping

# OpenMP's thread binding: meant for the engine's threads, not a compile worker's
BINDING_VARIABLES = ("KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")
# a compile is one thread: no library may start a pool of them
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def worker_cpus(cpus: Collection[int] | None = None) -> frozenset[int]:
    """The CPUs grammar workers may run on: `cpus` (the engine's own, if it was given some),
    else `offered_cpus()`."""
    return frozenset(cpus) if cpus else offered_cpus()


def offered_cpus(root: str = "/") -> frozenset[int]:
    """The CPUs the machine and this process's cgroup offer it: the cgroup's effective cpuset
    (v2, else v1) among the online CPUs; `os.cpu_count()` of them where neither can be read.
    A thread's affinity mask plays no part (the engine's main thread is bound to one core)."""
    online = _read_list(os.path.join(root, "sys/devices/system/cpu/online"))
    if online is None:
        online = frozenset(range(os.cpu_count() or 1))
    cpuset = _cgroup_cpuset(root)
    offered = online & cpuset if cpuset else online
    return offered or online


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment: `environ` without OpenMP's binding, one thread per library."""
    env = {name: value for name, value in environ.items() if name not in BINDING_VARIABLES}
    env.update(ONE_THREAD)
    return env


def release_binding(cpus: Collection[int]) -> None:
    """In a worker, before any OpenMP runtime loads: run on `cpus`, not the one core inherited
    from the engine thread that started it. A set the kernel refuses (a CPU gone offline, a
    cgroup changed since) leaves the inherited mask."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass


def format_cpus(cpus: Collection[int]) -> str:
    """"0,1,3": how a worker is told its CPUs on its command line."""
    return ",".join(str(cpu) for cpu in sorted(cpus))


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as the kernel writes it ("0-3,6") or as `format_cpus` does; "" is none."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def _read_list(path: str) -> frozenset[int] | None:
    try:
        with open(path) as f:
            return parse_cpus(f.read())
    except (OSError, ValueError):
        return None


def _cgroup_cpuset(root: str) -> frozenset[int] | None:
    """The effective CPUs of this process's cgroup: v2's cpuset.cpus.effective (from its own
    cgroup up to the root: a cgroup without the cpuset controller has no such file), else v1's
    cpuset.effective_cpus; None where neither is readable."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    mount = os.path.join(root, "sys/fs/cgroup")
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:  # v2
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                found = _read_list(os.path.join(mount, *parts[:depth], "cpuset.cpus.effective"))
                if found:
                    return found
        elif "cpuset" in controllers.split(","):  # v1
            parts = [p for p in path.split("/") if p]
            for name in ("cpuset.effective_cpus", "cpuset.cpus"):
                found = _read_list(os.path.join(mount, "cpuset", *parts, name))
                if found:
                    return found
    return None
