"""Builds and loads the CPU backend's C++ kernels (csrc/*.cpp, one extension per source file):
the decode-attention kernel (paged_decode.cpp), the block-format matmul (block_matmul.cpp), the
bf16 few-rows matmul (row_matmul.cpp) and the fused decode layers (decode_layers.cpp, which
includes the others' headers).

Compiled with torch's extension mechanism on first use of the backend (the engine's
warm-up, never at import), into `<cache root>/torch_extensions/<name>`, a directory
named after everything the binary depends on (the source, torch's version, the
Python ABI, this CPU's flags: it is built with -march=native), so a second start, and
every shard process, reuses it: a binary stamped as built (its size and mtime, written once
its ops loaded) is loaded as it is, with no lock and no ninja, so a cached start never waits
for another process's build nor recompiles a source whose mtime alone changed. A build takes
an exclusive file lock (the OS drops it with a dead holder) and clears torch's own lock file
under it, so a build killed half-way cannot leave later starts waiting forever; a start that
waits for a live builder names it, and says every few seconds that it still waits, as a
compile does. The first compile of a start says what a first start costs. When there is no compiler or the
build fails, `build_extension` returns an unavailable `ExtensionBuild` with the reason,
and the caller keeps its plain-torch path (the gather path, a dequantized weight).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

import torch

from switchyard.core.engine.heartbeat import Heartbeat

from .runtime import cpu_flags

logger = logging.getLogger(__name__)

SOURCES = os.path.join(os.path.dirname(__file__), "csrc")
SOURCE = os.path.join(SOURCES, "paged_decode.cpp")
BLOCK_SOURCE = os.path.join(SOURCES, "block_matmul.cpp")
DECODE_LAYERS_SOURCE = os.path.join(SOURCES, "decode_layers.cpp")
ROWS_SOURCE = os.path.join(SOURCES, "row_matmul.cpp")
# -fopenmp: at::parallel_for is inline OpenMP (ATen/ParallelOpenMP.h); without it the pragma is
# ignored and a kernel runs on one thread. The binaries then share torch's OpenMP runtime.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)

# The instruction-set levels a build can be held to, lowest first: the /proc/cpuinfo flags a level
# needs, and the compiler flags (after -march=native, so they only take features away) that keep
# a build at it. csrc/*.h pick their loops by the compiler's target macros: AVX-512 without VNNI
# runs the block kernel's AVX2 loop beside AVX-512 attention; "portable" is plain C++ (the loops
# an ARM or a pre-AVX2 CPU runs), held there on any x86 machine.
_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ISA_LEVELS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "portable": (frozenset(), ("-DSY_BLOCK_PORTABLE", "-mno-avx512f", "-mno-avx2")),
    "avx2": (_AVX2, ("-mno-avx512f",)),
    "avx512": (_AVX512, ("-mno-avx512vnni", "-mno-avx512bf16", "-mno-amx-tile")),
    "avx512-vnni": (_AVX512 | {"avx512_vnni"}, ("-mno-amx-tile",)),
    "amx": (_AVX512 | {"avx512_vnni", "amx_tile", "amx_int8"}, ()),
}


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64", "i686")


def isa_levels(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The levels this CPU runs, lowest first (the last is what "auto" builds)."""
    flags = cpu_flags() if flags is None else flags
    if not _x86():
        return ("portable",)
    return tuple(level for level, (needs, _) in ISA_LEVELS.items() if needs <= flags)


def resolve_isa(isa: str, flags: frozenset[str] | None = None) -> str:
    """The level a build runs at: `isa` itself, or the best this CPU runs for "auto"."""
    return isa_levels(flags)[-1] if isa == "auto" else isa


# What each level hides of a CPU's flags (names, or prefixes ending in "*").
_HIDDEN = {"portable": ("avx2", "fma", "f16c", "avx512*", "amx*"), "avx2": ("avx512*", "amx*"),
           "avx512": ("avx512_vnni", "avx512_bf16", "amx*"), "avx512-vnni": ("amx*",), "amx": ()}


def level_flags(isa: str, flags: frozenset[str] | None = None) -> frozenset[str]:
    """This CPU's flags as a CPU of level `isa` shows them (what decides, e.g., whether bfloat16
    is multiplied natively)."""
    flags = cpu_flags() if flags is None else flags
    hidden = _HIDDEN[resolve_isa(isa, flags)]
    return frozenset(f for f in flags if not any(f == h or (h.endswith("*") and f.startswith(h[:-1])) for h in hidden))


def compile_flags(isa: str) -> tuple[str, ...]:
    """CFLAGS and the level's flags; elsewhere than x86 (whose compilers know no -mno-avx2) the
    native build is the portable one."""
    return (*CFLAGS, *ISA_LEVELS[resolve_isa(isa)][1]) if _x86() else CFLAGS


@dataclass(frozen=True)
class ExtensionBuild:
    """The outcome of one build-or-reuse. `ops` is the extension's op namespace
    (torch.ops.<name>; None when unavailable)."""

    ops: Any | None
    reason: str  # why it is unavailable; "" when available
    directory: str
    seconds: float
    cache_hit: bool  # the binary was already built: nothing was compiled

    @property
    def available(self) -> bool:
        return self.ops is not None

    @property
    def name(self) -> str:
        return os.path.basename(self.directory)


@dataclass(frozen=True)
class PagedDecodeBuild:
    """The decode-attention extension's build. `op` is the loaded kernel (None when unavailable):
    op(out, query, kv_cache, block_table, seq_lens, scale, window, soft_cap)."""

    op: Callable[..., None] | None
    reason: str
    directory: str
    seconds: float
    cache_hit: bool

    @property
    def available(self) -> bool:
        return self.op is not None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _source_texts(source: str) -> list[bytes]:
    """The source and the headers beside it (it may include them): a change to any rebuilds."""
    folder = os.path.dirname(source)
    headers = sorted(name for name in os.listdir(folder) if name.endswith(".h"))
    texts = []
    for path in [source, *(os.path.join(folder, name) for name in headers)]:
        with open(path, "rb") as file:
            texts.append(file.read())
    return texts


def build_name(source: str, cache_root: str, isa: str = "auto") -> str:
    """The extension's name (also its op namespace): a digest of what the binary depends on
    (its instruction-set level's flags too), and of where it is kept (two builds loaded in one
    process must not share a namespace)."""
    key = b"\0".join([*_source_texts(source), os.path.abspath(cache_root).encode(), torch.__version__.encode(),
                      sys.version.encode(), platform.machine().encode(), _cpu_flags().encode(),
                      " ".join(compile_flags(isa)).encode()])
    stem = os.path.splitext(os.path.basename(source))[0]
    return f"switchyard_{stem}_" + hashlib.sha256(key).hexdigest()[:16]


def build_directory(cache_root: str, name: str) -> str:
    return os.path.join(cache_root, "torch_extensions", name)


def _missing_tools() -> str:
    compiler = os.environ.get("CXX", "c++")  # torch's own rule for which compiler it calls
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found)"
    return "" if shutil.which("ninja") else "ninja not found"


def stamp_path(directory: str, name: str) -> str:
    """Written beside a binary once it was built and its ops checked: the binary's size and mtime."""
    return os.path.join(directory, f"{name}.so.built")


def _stamp_of(binary: str) -> str:
    stat = os.stat(binary)
    return f"{stat.st_size} {stat.st_mtime_ns}\n"


def _is_stamped(binary: str, stamp: str) -> bool:
    try:
        with open(stamp) as file:
            return file.read() == _stamp_of(binary)
    except OSError:
        return False


def _write_stamp(binary: str, stamp: str) -> None:
    staging = f"{stamp}.{os.getpid()}"
    with open(staging, "w") as file:
        file.write(_stamp_of(binary))
    os.replace(staging, stamp)


def _reuse(name: str, binary: str, stamp: str, what: str) -> Any | None:
    """A stamped binary, loaded as it is: no lock, no ninja (which would rebuild a source whose
    mtime alone changed), nothing compiled. None when there is none; one that no longer loads
    loses its stamp and binary, so the build under the lock makes it again."""
    if not _is_stamped(binary, stamp):
        return None
    try:
        torch.ops.load_library(binary)
        return getattr(torch.ops, name)
    except Exception as error:  # noqa: BLE001 - a damaged binary: rebuilt
        logger.warning("%s: the built kernel %s does not load (%s); building it again", what, binary, error)
        for path in (stamp, binary):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        return None


def _holder(path: str) -> tuple[str, str]:
    """Who holds a build lock, short and with its command line: the pid its holder wrote there."""
    try:
        with open(path) as file:
            pid = int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return "another process", "another process"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"process {pid}", f"process {pid}" + (f" ({command[:160]})" if command else "")


@contextlib.contextmanager
def _build_lock(directory: str, what: str):
    """The directory's exclusive lock (released by the OS if its holder dies, so a dead holder never
    stalls a start); a start that must wait says for whom, and every few seconds that it still
    does. Yields the seconds it waited."""
    path = os.path.join(directory, ".build.lock")
    with open(path, "a+") as lock:  # "a+": the holder's pid stays readable
        waited = 0.0
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            (holder, described), began = _holder(path), time.perf_counter()
            logger.info("%s: waiting for %s, which is building this kernel in %s", what, described, directory)
            with Heartbeat(lambda s: logger.info("%s: still waiting for %s's build (%.0f s)", what, holder, s)):
                fcntl.flock(lock, fcntl.LOCK_EX)
            waited = time.perf_counter() - began
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        try:
            yield waited
        finally:
            lock.truncate(0)


_FIRST_START_SAID = False


def _say_first_start(cache_root: str) -> None:
    """Once per process, before its first compile: what a first start costs."""
    global _FIRST_START_SAID
    if not _FIRST_START_SAID:
        _FIRST_START_SAID = True
        logger.info("first start: building CPU kernels, about a minute or two, cached afterwards (in %s)",
                    os.path.join(cache_root, "torch_extensions"))


def _compile(name: str, source: str, directory: str, what: str, isa: str) -> tuple[Any, float]:
    """(the ops, seconds spent waiting for another process's build): torch's build under the
    directory's lock, torch's own lock file (which only a dead build leaves there) cleared first."""
    from torch.utils.cpp_extension import load

    with _build_lock(directory, what) as waited:
        stale = os.path.join(directory, "lock")  # torch's FileBaton: it would wait for it forever
        if os.path.exists(stale):
            logger.info("%s: removed the lock file %s of a build that did not finish", what, stale)
            os.remove(stale)
        with Heartbeat(lambda s: logger.info("%s: still compiling %s (%.0f s)", what, os.path.basename(source), s)):
            load(name=name, sources=[source], extra_cflags=list(compile_flags(isa)), extra_ldflags=list(LDFLAGS),
                 build_directory=directory, is_python_module=False, verbose=False)
    return getattr(torch.ops, name), waited


def _first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = next((line for line in lines if "error" in line.lower() and "Error building" not in line),
                lines[0] if lines else "no message")
    return line[:300]


@cache
def build_extension(cache_root: str, source: str, what: str, fallback: str,
                    op_names: tuple[str, ...], isa: str = "auto") -> ExtensionBuild:
    """Builds (or reuses) the extension of `source` under `cache_root`, once per process; never
    raises. what / fallback: the kernel and the path taken without it, for the log lines;
    op_names: the ops it must register (a binary that loads without them is unavailable, as
    happens under another torch's ABI); isa: the instruction-set level (ISA_LEVELS) it is built for."""
    name = build_name(source, cache_root, isa)
    directory = build_directory(cache_root, name)
    missing = _missing_tools()
    if missing:
        logger.warning("%s: %s, the kernel cannot be built: %s", what, fallback, missing)
        return ExtensionBuild(None, missing, directory, 0.0, False)
    binary = os.path.join(directory, f"{name}.so")
    stamp = stamp_path(directory, name)
    began, waited = time.perf_counter(), 0.0
    try:
        ops = _reuse(name, binary, stamp, what)
        was_built = ops is not None or os.path.exists(binary)
        if ops is None:
            if not was_built:
                _say_first_start(cache_root)
                logger.info("%s: compiling %s", what, os.path.basename(source))
            os.makedirs(directory, exist_ok=True)
            ops, waited = _compile(name, source, directory, what, isa)
        for op_name in op_names:
            getattr(ops, op_name)  # raises AttributeError when the binary did not register it
        if not _is_stamped(binary, stamp):
            _write_stamp(binary, stamp)
    except Exception as error:  # a compiler error, a missing header, an unloadable binary
        reason = f"build failed ({type(error).__name__}: {_first_error_line(str(error))})"
        logger.warning("%s: %s, %s; build directory %s", what, fallback, reason, directory)
        return ExtensionBuild(None, reason, directory, time.perf_counter() - began, False)
    seconds = time.perf_counter() - began
    wait = f", {waited:.1f} s of it waiting for another process's build" if waited >= 0.1 else ""
    logger.info("%s: kernel %s in %.1f s%s (%s)", what, "reused" if was_built else "compiled", seconds, wait,
                directory)
    return ExtensionBuild(ops, "", directory, seconds, was_built)


_FAKES: set[str] = set()


def register_fake_once(build: ExtensionBuild, op_name: str, fake: Callable[..., Any]) -> None:
    """Registers `fake` as the fake implementation (for torch.compile) of an available build's
    op, once per process and build."""
    qualified = f"{build.name}::{op_name}"
    if build.available and qualified not in _FAKES:
        torch.library.register_fake(qualified)(fake)
        _FAKES.add(qualified)


def build_paged_decode(cache_root: str, source: str = SOURCE, isa: str = "auto") -> PagedDecodeBuild:
    """The in-place decode-attention kernel (the gather path without it)."""
    build = build_extension(cache_root, source, "CPU decode attention", "gather path", ("paged_decode",), isa)
    return PagedDecodeBuild(build.ops.paged_decode if build.available else None, build.reason, build.directory,
                            build.seconds, build.cache_hit)


class PagedDecode:
    """Which decode-attention path the CPU kernels take: decided once per engine, at
    warm-up (`load`), and shared by the backend and every layer's kernel. Until loaded,
    when disabled (the switch that forces the gather path) or when the build failed,
    `op` is None and the kernels gather."""

    def __init__(self, enabled: bool = True, max_decodes: int | None = None) -> None:
        self.enabled = enabled
        self.max_decodes = max_decodes  # larger decode batches gather (None: no limit)
        self.build: PagedDecodeBuild | None = None
        # the loaded op's torch name ("namespace::paged_decode"), which compiled graphs call it by
        self.op_name: str | None = None

    def serves(self, num_decodes: int) -> bool:
        """Whether a step with this many decodes attends them in place."""
        return (self.op is not None and num_decodes > 0
                and (self.max_decodes is None or num_decodes <= self.max_decodes))

    def load(self, cache_root: str, source: str = SOURCE, isa: str = "auto") -> PagedDecodeBuild | None:
        if self.enabled and self.build is None:
            self.build = build_paged_decode(cache_root, source, isa)
            if self.build.available:
                self.op_name = self.build.op.default.name()
        return self.build

    @property
    def op(self) -> Callable[..., None] | None:
        return self.build.op if self.build is not None else None

    def describe(self, cache_root: str) -> str:
        """For `switchyard backends`: the path in use, or the one a start would take."""
        limit = "" if self.max_decodes is None else f" for steps of up to {self.max_decodes} decodes"
        return self._path(cache_root).replace("in-place paged kernel", "in-place paged kernel" + limit, 1)

    def _path(self, cache_root: str) -> str:
        if not self.enabled:
            return "gather path (forced)"
        if self.build is not None:
            if not self.build.available:
                return f"gather path ({self.build.reason})"
            return f"in-place paged kernel (C++ extension, {self.build.directory})"
        missing = _missing_tools()
        if missing:
            return f"gather path ({missing})"
        name = build_name(SOURCE, cache_root)
        built = os.path.exists(os.path.join(build_directory(cache_root, name), f"{name}.so"))
        return ("in-place paged kernel (C++ extension, " + ("built" if built else "compiled at first start")
                + f" under {os.path.join(cache_root, 'torch_extensions')}; gather path if the build fails)")
