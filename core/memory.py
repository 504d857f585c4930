"""Giving memory freed during start-up back to the OS: the heap pages loading freed, and the
resident pages of weight files that stay mapped (a GGUF embedding is read from its file), all
of them at once or one repacked tensor's at a time (MappedWeightPages, while a backend packs).

Loading a model allocates and frees a lot on the C heap (a GGUF file's tensors repacked into
kernel tiles, conversion temporaries, the warm-up's buffers). glibc keeps freed heap pages
resident for reuse unless they sit at the heap's very top, so an idle engine held ~80-100 MB more
RSS than it used: the default model's served engine, idle, 688 MB before and 611 MB after a trim
(2-core AMX Xeon). Under load the peak is the same either way (the KV cache's pages fill in as its
blocks are used). `malloc_trim(0)` hands every whole free page back; elsewhere (musl, macOS) there
is no such call and nothing is done. The engine loop trims again once idle after serving
(core/engine/loop.py IDLE_TRIM_S): a CPU engine on glibc keeps its large activations on the heap
between steps (backends/cpu/runtime.py).

Not done: fixing glibc's mmap threshold low (1 MiB) so that a long prompt's freed activations
leave the heap too. It saved ~50 MB after a 1,400-token prompt but made that prompt's prefill
1.55x slower (0.99 -> 1.54 s: every activation paid its page faults); at 8 or 32 MiB it saved
nothing."""
from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)


def status_kib(field: str, pid: int | str = "self", proc: str = "/proc") -> int | None:
    """The `field` line of /proc/PID/status (VmRSS, VmHWM...) in KiB; None when the process is
    gone or the line is missing or unreadable."""
    try:
        with open(os.path.join(proc, str(pid), "status")) as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def release_freed_memory() -> bool:
    """What loading no longer needs, handed back: the pages of weight files still mapped
    (`drop_mapped_weight_pages`) and glibc's malloc_trim(0) of the heap. False where the C
    library has no malloc_trim."""
    before = status_kib("VmRSS")
    drop_mapped_weight_pages()
    if not trim_heap():
        return False
    after = status_kib("VmRSS")
    if before is not None and after is not None:
        logger.info("returned %.0f MB of memory freed at start-up to the OS (resident: %.0f MB)",
                    (before - after) / 1024, after / 1024)
    return True


def trim_heap() -> bool:
    """glibc's malloc_trim(0): every whole free page of the heap back to the OS. False where the
    C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


WEIGHT_FILE_SUFFIXES = (".gguf", ".safetensors")
MADV_DONTNEED = 4
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def mapped_weight_ranges(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of weight files (WEIGHT_FILE_SUFFIXES)."""
    ranges = []
    try:
        with open(maps) as lines:
            for line in lines:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n").endswith(WEIGHT_FILE_SUFFIXES):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return ranges


def drop_mapped_weight_pages() -> int:
    """madvise(MADV_DONTNEED) over every mapped weight file: the pages loading read (to repack
    them, e.g. a tied LM head from a GGUF embedding the model keeps mapped) leave the resident
    set and stay in the page cache; a later read faults its page back in. Bytes dropped."""
    ranges = mapped_weight_ranges()
    if not ranges:
        return 0
    madvise = _madvise()
    return sum(end - start for start, end in ranges if madvise(start, end - start, MADV_DONTNEED) == 0)


class MappedWeightPages:
    """One tensor's file pages at a time: a backend that repacks a weight held in a mapped file
    calls `drop(tensor)` once it is done with it, so the file pages packing reads leave the
    resident set as it goes, instead of all the file's (a 7B GGUF's 4 GB) adding to the
    packed copy's until the end. The weight files' mappings are read once, at construction;
    a tensor outside them (anonymous memory, which DONTNEED would zero) is never touched."""

    def __init__(self):
        self._ranges = mapped_weight_ranges()
        self._madvise = _madvise() if self._ranges else None

    def drop(self, tensor) -> int:
        """Bytes of `tensor`'s storage dropped (whole pages, widened to its pages' bounds: a
        neighbour's page dropped with it is read back from the page cache); 0 when it does
        not lie in a mapped weight file."""
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        end = start + storage.nbytes()
        for low, high in self._ranges:
            if low <= start and end <= high:
                first, last = start - start % PAGE, min(high, -(-end // PAGE) * PAGE)
                return last - first if self._madvise(first, last - first, MADV_DONTNEED) == 0 else 0
        return 0


def _madvise():
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise
