"""Builds and loads the CPU backend's C++ kernels (csrc/*.cpp, one extension per source file):
the decode-attention kernel (paged_decode.cpp), the block-format matmul (block_matmul.cpp), the
bf16 few-rows matmul (row_matmul.cpp) and the fused decode layers (decode_layers.cpp, which
includes the others' headers).

Compiled with torch's extension mechanism on first use of the backend (the engine's
warm-up, never at import), into `<cache root>/torch_extensions/<name>`, a directory
named after everything the binary depends on (the source, torch's version, the
Python ABI, this CPU's flags: it is built with -march=native), so a second start, and
every shard process, reuses it. An exclusive file lock serialises concurrent builds;
torch's own lock file inside the directory is cleared under it, so a build killed
half-way cannot leave later starts waiting forever. When there is no compiler or the
build fails, `build_extension` returns an unavailable `ExtensionBuild` with the reason,
and the caller keeps its plain-torch path (the gather path, a dequantized weight).
"""
from __future__ import annotations

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


def build_name(source: str, cache_root: str) -> str:
    """The extension's name (also its op namespace): a digest of what the binary depends on,
    and of where it is kept (two builds loaded in one process must not share a namespace)."""
    key = b"\0".join([*_source_texts(source), os.path.abspath(cache_root).encode(), torch.__version__.encode(),
                      sys.version.encode(), platform.machine().encode(), _cpu_flags().encode(), " ".join(CFLAGS).encode()])
    stem = os.path.splitext(os.path.basename(source))[0]
    return f"switchyard_{stem}_" + hashlib.sha256(key).hexdigest()[:16]


def build_directory(cache_root: str, name: str) -> str:
    return os.path.join(cache_root, "torch_extensions", name)


def _missing_tools() -> str:
    compiler = os.environ.get("CXX", "c++")  # torch's own rule for which compiler it calls
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found)"
    return "" if shutil.which("ninja") else "ninja not found"


def _compile(name: str, source: str, directory: str) -> Any:
    from torch.utils.cpp_extension import load

    with open(os.path.join(directory, ".build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS if this process dies
        stale = os.path.join(directory, "lock")  # torch's FileBaton; only a dead build leaves it here
        if os.path.exists(stale):
            os.remove(stale)
        load(name=name, sources=[source], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
             build_directory=directory, is_python_module=False, verbose=False)
    return getattr(torch.ops, name)


def _first_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = next((line for line in lines if "error" in line.lower() and "Error building" not in line),
                lines[0] if lines else "no message")
    return line[:300]


@cache
def build_extension(cache_root: str, source: str, what: str, fallback: str,
                    op_names: tuple[str, ...]) -> ExtensionBuild:
    """Builds (or reuses) the extension of `source` under `cache_root`, once per process; never
    raises. what / fallback: the kernel and the path taken without it, for the log lines;
    op_names: the ops it must register (a binary that loads without them is unavailable, as
    happens under another torch's ABI)."""
    name = build_name(source, cache_root)
    directory = build_directory(cache_root, name)
    missing = _missing_tools()
    if missing:
        logger.warning("%s: %s, the kernel cannot be built: %s", what, fallback, missing)
        return ExtensionBuild(None, missing, directory, 0.0, False)
    binary = os.path.join(directory, f"{name}.so")
    was_built = os.path.exists(binary)
    began = time.perf_counter()
    try:
        os.makedirs(directory, exist_ok=True)
        ops = _compile(name, source, directory)
        for op_name in op_names:
            getattr(ops, op_name)  # raises AttributeError when the binary did not register it
    except Exception as error:  # a compiler error, a missing header, an unloadable binary
        reason = f"build failed ({type(error).__name__}: {_first_error_line(str(error))})"
        logger.warning("%s: %s, %s; build directory %s", what, fallback, reason, directory)
        return ExtensionBuild(None, reason, directory, time.perf_counter() - began, False)
    seconds = time.perf_counter() - began
    logger.info("%s: kernel %s in %.1f s (%s)", what, "reused" if was_built else "compiled", seconds, directory)
    return ExtensionBuild(ops, "", directory, seconds, was_built)


_FAKES: set[str] = set()


def register_fake_once(build: ExtensionBuild, op_name: str, fake: Callable[..., Any]) -> None:
    """Registers `fake` as the fake implementation (for torch.compile) of an available build's
    op, once per process and build."""
    qualified = f"{build.name}::{op_name}"
    if build.available and qualified not in _FAKES:
        torch.library.register_fake(qualified)(fake)
        _FAKES.add(qualified)


def build_paged_decode(cache_root: str, source: str = SOURCE) -> PagedDecodeBuild:
    """The in-place decode-attention kernel (the gather path without it)."""
    build = build_extension(cache_root, source, "CPU decode attention", "gather path", ("paged_decode",))
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

    def load(self, cache_root: str, source: str = SOURCE) -> PagedDecodeBuild | None:
        if self.enabled and self.build is None:
            self.build = build_paged_decode(cache_root, source)
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
