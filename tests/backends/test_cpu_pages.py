"""The CPU backend's page policies (backends/cpu/pages.py): packed weights on transparent huge
pages where the system grants them, the KV cache on small pages, and the packed bytes unchanged."""
from __future__ import annotations

import mmap
import sys

import pytest
import torch

from switchyard.backends.cpu.block_pack import pack_blocks, unpack_reference
from switchyard.backends.cpu.pages import HUGE_PAGE, MIN_HUGE_BYTES, huge_page_tensor, join_on_huge_pages, small_pages

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_cpu_quant import weight_of  # noqa: E402


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _flags_of(address: int) -> tuple[int, set[str]]:
    """AnonHugePages (kB) and VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    huge, flags, inside = 0, set(), False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
        elif inside and head == "VmFlags:":
            flags = set(line.split()[1:])
    return huge, flags


def test_small_weights_keep_their_memory():
    one = torch.arange(MIN_HUGE_BYTES - 1, dtype=torch.int64).to(torch.uint8)
    assert join_on_huge_pages([one]) is one  # no copy
    assert torch.equal(join_on_huge_pages([one[:1000], one[1000:]]), one)


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")
def test_large_weights_start_on_a_huge_page_advised_onto_them():
    nbytes = 3 * HUGE_PAGE + 12345
    t = huge_page_tensor(nbytes)
    assert t.numel() == nbytes and t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)  # first touch: the kernel places the pages now
    assert int(t.sum()) == 7 * nbytes
    huge, flags = _flags_of(t.data_ptr())
    assert "hg" in flags  # the aligned middle is advised (its own VMA after the split)
    _, tail_flags = _flags_of(t.data_ptr() + 3 * HUGE_PAGE)
    assert "nh" in tail_flags  # the tail is not: it never takes a whole 2 MiB page
    if _thp_mode() in ("always", "madvise"):
        assert huge > 0  # granted where the system has free huge pages (it had here)


def test_packed_weights_keep_their_bytes_on_huge_pages():
    weight = weight_of("q4_k", 4096, 2048, seed=3)  # ~4.7 MB of tiles: past MIN_HUGE_BYTES
    packed = pack_blocks(weight)
    assert packed.data.numel() >= MIN_HUGE_BYTES and packed.data.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(unpack_reference(packed), weight.dequantize())


def test_kv_pages_are_advised_off_huge_pages():
    mapping = small_pages(4 * HUGE_PAGE)
    t = torch.frombuffer(mapping, dtype=torch.uint8)
    assert int(t[:4096].sum()) == 0  # zero-filled
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        assert "nh" in _flags_of(t.data_ptr())[1]
