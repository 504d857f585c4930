"""core/memory.py: freed heap pages go back to the OS (glibc's malloc_trim)."""
from __future__ import annotations

import ctypes
import platform

import pytest

from switchyard.core.memory import MappedWeightPages, drop_mapped_weight_pages, release_freed_memory, status_kib


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


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc and madvise")
def test_mapped_weight_file_pages_leave_the_resident_set_and_stay_readable(tmp_path):
    """A GGUF embedding stays mapped for lookups; the pages loading read of it are dropped
    (core/memory.py) and fault back in, unchanged, when read again."""
    import mmap

    path = tmp_path / "weights.gguf"
    size = 64 << 20
    path.write_bytes(bytes(range(256)) * (size // 256))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        assert sum(mapped[i] for i in range(0, size, 4096)) == 0  # every page touched (byte 0 of each)
        before = status_kib("RssFile")
        assert drop_mapped_weight_pages() >= size
        after = status_kib("RssFile")
        assert before - after > 50 * 1024, (before, after)
        assert mapped[size - 1] == 255 and mapped[4097] == 1
    finally:
        mapped.close()


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc and madvise")
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_one_mapped_tensor_pages_are_dropped_and_anonymous_memory_is_never_touched(tmp_path):
    """A backend drops each weight's file pages once it has repacked it: only that tensor's
    pages leave (read back unchanged later), and a tensor outside a weight file (anonymous
    memory, which DONTNEED would zero) is left as it is."""
    import numpy as np
    import torch

    path = tmp_path / "weights.gguf"
    size = 64 << 20
    path.write_bytes(bytes(range(256)) * (size // 256))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    first, second = (torch.from_numpy(mapped[i * size // 2:(i + 1) * size // 2]) for i in range(2))
    anonymous = torch.full((size // 2,), 7, dtype=torch.uint8)
    pages = MappedWeightPages()
    assert int(first.sum()) == int(second.sum())  # both halves resident
    before = status_kib("RssFile")
    assert pages.drop(first) >= size // 2
    middle = status_kib("RssFile")
    assert before - middle > 24 * 1024, (before, middle)
    assert pages.drop(anonymous) == 0 and bool((anonymous == 7).all())
    assert status_kib("RssFile") - middle < 1024  # the second half stayed resident
    assert first[4097].item() == 1 and second[-1].item() == 255


def test_the_engine_loop_trims_the_heap_once_idle_after_steps(monkeypatch):
    """core/engine/loop.py: IDLE_TRIM_S after the last step, once per busy spell, never while
    requests run (a CPU engine's activations stay on the heap between steps: backends/cpu/runtime.py)."""
    from types import SimpleNamespace

    from switchyard.core.engine import loop as loop_module

    trims = []
    monkeypatch.setattr(loop_module, "trim_heap", lambda: trims.append(1) or True)
    busy = [False]
    engine = SimpleNamespace(finish_request=lambda *a: None, has_unfinished_requests=lambda: busy[0])
    loop = loop_module.EngineLoop(channel=None, engine=engine, tokenizer=None)
    idle = loop_module.IDLE_TRIM_S
    assert not loop._release_when_idle(1e6)  # no step yet: nothing to give back
    loop._last_step = 100.0
    busy[0] = True
    assert not loop._release_when_idle(100.0 + 2 * idle)  # requests running
    busy[0] = False
    assert not loop._release_when_idle(100.0 + idle / 2)  # idle, not for long
    assert loop._release_when_idle(100.0 + idle) and trims == [1]
    assert not loop._release_when_idle(100.0 + 3 * idle) and trims == [1]  # once per spell
