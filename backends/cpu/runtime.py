"""How a CPU engine process should run: the allocator and OpenMP runtime it preloads, its
threads and where they are bound. Torch-free: it only looks at files, so the engine process
can decide before torch is loaded (LD_PRELOAD takes effect only when a process starts).

What a tuned CPU engine does, as vLLM's CPU worker does it:
- a faster allocator preloaded: tcmalloc (libtcmalloc_minimal.so.4 / libtcmalloc.so.4),
  else jemalloc (libjemalloc.so.2), found in the usual library folders or `ldconfig -p`;
- Intel OpenMP (libiomp5.so from the `intel-openmp` wheel, under sys.prefix/lib) preloaded
  so torch's OpenMP calls go to it (it exports GNU OpenMP's entry points), with a short
  spin time before sleeping (KMP_BLOCKTIME=1), no power-saving pause (KMP_TPAUSE=0) and
  distributed barriers: vLLM's settings;
- where neither is found, glibc's malloc with its large blocks kept on the heap
  (GLIBC_TUNABLES: mmap_max=0, a trim threshold too high to reach): by default every block of
  32 MiB or more (a prompt chunk's activations: 1,505 tokens of a 1.7B model's MLP are 98 MB) is
  mapped fresh and unmapped again, so each layer of each prompt paid page faults and the kernel's
  zeroing of its outputs. Kept on the heap they reuse freed pages: 2-core Zen 4, the 1.7B
  Q4_K_M's 1,505-token prompt 1.09-1.13x faster, its peak RSS 9% higher (3.2 against 2.9 GB;
  llama-server's is 1.3x ours). The engine loop hands the free pages back to the OS once idle
  (core/engine/loop.py), as tcmalloc does in the background;
- one thread per physical core this process may run on (os.sched_getaffinity; one logical
  CPU per core when there are hyperthreads), each bound to its own core (KMP_AFFINITY with
  Intel OpenMP, OMP_PROC_BIND/OMP_PLACES with GNU OpenMP).

Binding pins the process's main thread too (to the first core, when OpenMP starts), and a
process started after that inherits the one-core mask: so it is done only when the engine
process is the model's one process (unsharded), never for shard processes, which take their
own slice of the cores (backend.py shard_cores)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

# Allocators in order of preference: (name, file names).
ALLOCATORS = (("tcmalloc", ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")), ("jemalloc", ("libjemalloc.so.2",)))
INTEL_OPENMP = "libiomp5.so"
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                "/usr/lib64", "/lib64", "/usr/local/lib", "/usr/lib", "/lib")
# Intel OpenMP settings vLLM's CPU platform uses (see the module docstring).
KMP_SETTINGS = {"KMP_BLOCKTIME": "1", "KMP_TPAUSE": "0", "KMP_FORKJOIN_BARRIER_PATTERN": "dist,dist",
                "KMP_PLAIN_BARRIER_PATTERN": "dist,dist", "KMP_REDUCTION_BARRIER_PATTERN": "dist,dist"}
MODES = ("tuned", "plain")
# glibc's malloc where no allocator is preloaded: never mmap a block, never trim the heap's top on
# free (the module docstring); the user's own GLIBC_TUNABLES come after ours and win.
GLIBC_HEAP_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"


@dataclass(frozen=True)
class Library:
    name: str  # "tcmalloc", "jemalloc", "libiomp5"
    path: str


def ldconfig_libraries() -> dict[str, str]:
    """File name -> path of the libraries the dynamic linker's cache knows ({} without ldconfig)."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, str] = {}
    for line in out.splitlines():
        name, arrow, path = line.strip().partition(" => ")
        if arrow and ("x86-64" in name or "64" in name or "," not in name):
            found.setdefault(name.split(" ", 1)[0], path.strip())
    return found


def find_library(file_names: Iterable[str], dirs: Iterable[str], known: Mapping[str, str]) -> str | None:
    """The first of file_names present in one of dirs, else in `known` (ldconfig's cache)."""
    file_names = tuple(file_names)
    for name in file_names:
        for folder in dirs:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    for name in file_names:
        if name in known and os.path.isfile(known[name]):
            return known[name]
    return None


def find_allocator(dirs: Iterable[str] = LIBRARY_DIRS, known: Mapping[str, str] | None = None) -> Library | None:
    dirs = tuple(dirs)
    known = ldconfig_libraries() if known is None else known
    for name, file_names in ALLOCATORS:
        path = find_library(file_names, dirs, known)
        if path is not None:
            return Library(name, path)
    return None


def find_intel_openmp(prefixes: Iterable[str] = (sys.prefix, sys.base_prefix)) -> Library | None:
    """libiomp5.so where the `intel-openmp` wheel installs it: <prefix>/lib."""
    path = find_library((INTEL_OPENMP,), [os.path.join(prefix, "lib") for prefix in prefixes], {})
    return None if path is None else Library("libiomp5", path)


def physical_cores(cpus: Iterable[int], sysfs: str = "/sys/devices/system/cpu") -> tuple[int, ...]:
    """One logical CPU (the lowest) per physical core among `cpus`; a CPU whose topology
    cannot be read counts as its own core."""
    chosen: dict[tuple[str, str] | int, int] = {}
    for cpu in sorted(cpus):
        topology = os.path.join(sysfs, f"cpu{cpu}", "topology")
        try:
            with open(os.path.join(topology, "physical_package_id")) as package, \
                    open(os.path.join(topology, "core_id")) as core:
                key: tuple[str, str] | int = (package.read().strip(), core.read().strip())
        except OSError:
            key = cpu
        chosen.setdefault(key, cpu)
    return tuple(sorted(chosen.values()))


@dataclass(frozen=True)
class CpuRuntime:
    """What a tuned engine process runs with; `environment()` is how it is asked for."""

    allocator: Library | None  # None: the C library's malloc
    openmp: Library | None  # None: the GNU OpenMP torch ships with
    cores: tuple[int, ...]  # one per thread
    bind: bool  # each OpenMP thread bound to its core

    @property
    def threads(self) -> int:
        return len(self.cores)

    def environment(self, current: Mapping[str, str]) -> dict[str, str]:
        """The variables to start the process with, merged into `current` (the user's):
        our libraries go first in LD_PRELOAD, before the user's own; a variable the user
        set (OMP_NUM_THREADS, KMP_*, OMP_PROC_BIND, ...) is kept as the user set it."""
        ours: dict[str, str] = {"OMP_NUM_THREADS": str(self.threads)}
        if self.openmp is not None:
            ours.update(KMP_SETTINGS)
            if self.bind:
                ours["KMP_AFFINITY"] = f"granularity=fine,proclist=[{','.join(map(str, self.cores))}],explicit"
        elif self.bind:
            ours.update(OMP_PROC_BIND="close", OMP_PLACES=",".join(f"{{{core}}}" for core in self.cores))
        merged = {name: current.get(name, value) for name, value in ours.items()}
        if self.allocator is None:
            tunables = current.get("GLIBC_TUNABLES", "")  # ours already in it: this environment's own
            if GLIBC_HEAP_TUNABLES not in tunables:
                tunables = ":".join(filter(None, (GLIBC_HEAP_TUNABLES, tunables)))
            merged["GLIBC_TUNABLES"] = tunables
        preload = [lib.path for lib in (self.allocator, self.openmp) if lib is not None]
        if preload:
            users = [entry for entry in current.get("LD_PRELOAD", "").replace(":", " ").split() if entry]
            merged["LD_PRELOAD"] = " ".join(dict.fromkeys(preload + users))
        return merged

    def describe(self) -> str:
        allocator = ("glibc malloc, large blocks kept on the heap" if self.allocator is None
                     else f"{self.allocator.name} ({self.allocator.path})")
        openmp = "GNU OpenMP (torch's)" if self.openmp is None else f"Intel OpenMP ({self.openmp.path})"
        cores = ",".join(map(str, self.cores))
        return (f"allocator {allocator}; OpenMP {openmp}; {self.threads} threads on cores {cores}"
                f"{', bound' if self.bind else ', unbound'}")


def plan_runtime(sharded: bool = False, allocator: Library | None = None, openmp: Library | None = None,
                 cpus: Iterable[int] | None = None) -> CpuRuntime:
    """The tuned runtime of this machine (the found libraries unless given)."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    return CpuRuntime(allocator=allocator if allocator is not None else find_allocator(),
                      openmp=openmp if openmp is not None else find_intel_openmp(),
                      cores=physical_cores(cpus), bind=not sharded)


@lru_cache(maxsize=2)
def this_machine(sharded: bool = False) -> CpuRuntime:
    """plan_runtime() once per process (ldconfig and sysfs are read once)."""
    return plan_runtime(sharded)


def loaded_libraries(maps: str = "/proc/self/maps") -> tuple[str, ...]:
    """The allocator and OpenMP runtimes mapped into this process, by name (what is in effect)."""
    try:
        with open(maps) as f:
            text = f.read()
    except OSError:
        return ()
    names = ("libtcmalloc", "libjemalloc", "libiomp5", "libgomp")
    return tuple(name for name in names if name in text)


# CPU features that multiply bfloat16 natively (/proc/cpuinfo names).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo has none, e.g. not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def prefers_bfloat16(flags: frozenset[str]) -> bool:
    return bool(flags & BF16_FLAGS)
