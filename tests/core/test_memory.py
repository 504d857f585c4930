"""core/memory.py: freed heap pages go back to the OS (glibc's malloc_trim)."""
from __future__ import annotations

import ctypes
import platform

import pytest

from switchyard.core.memory import release_freed_memory, status_kib


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_heap_pages_are_returned_to_the_os():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 KiB blocks stay on the heap (under glibc's mmap threshold); the last one, kept, pins the
    # heap's top so that freeing the others cannot shrink it by itself
    blocks = [libc.malloc(64 * 1024) for _ in range(1600)]
    for block in blocks:
        ctypes.memset(block, 1, 64 * 1024)  # resident
    for block in blocks[:-1]:
        libc.free(block)
    before = status_kib("VmRSS") / 1024
    assert release_freed_memory()
    after = status_kib("VmRSS") / 1024
    libc.free(blocks[-1])
    assert before - after > 50, (before, after)  # ~100 MB were freed
