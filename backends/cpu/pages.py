"""How the CPU backend's large buffers take their pages from the kernel.

- The KV cache grows as requests come: `small_pages`, advised off transparent huge pages, so a
  page is resident only once a block on it is written.
- Packed weights are read whole at every step: `huge_page_tensor`, advised onto transparent huge
  pages, so streaming them walks one TLB entry per 2 MiB instead of one per 4 KiB. A 2-core
  Zen 4, one row through ~0.5 GB of 7B-shaped Q4_K/Q6_K tiles, paired runs: the AVX2 loop 1.13x
  faster, AVX-512 1.02x, AVX512-VNNI 1.03x (docs/cpu.md). A weight starts on a 2 MiB boundary
  and only its whole 2 MiB pages are advised; its tail stays in 4 KiB pages, so no weight holds
  more than its bytes. Weights under MIN_HUGE_BYTES keep the allocator's memory
  (`join_on_huge_pages`).

Both work under every THP mode the system has ("never" simply gives 4 KiB pages); a tensor made
from either mapping (torch.frombuffer) keeps it alive.
"""
from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
# Below this a weight would hold one whole 2 MiB page at most: the allocator's memory serves it.
MIN_HUGE_BYTES = 2 * HUGE_PAGE


def small_pages(nbytes: int) -> mmap.mmap:
    """An anonymous, zero-filled mapping of `nbytes` whose pages come 4 KiB at a time on first
    touch: advised off huge pages, whatever the system's THP mode."""
    mapping = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return mapping


def huge_page_tensor(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` (from a private anonymous mapping, starting on a
    2 MiB boundary) whose whole 2 MiB pages are advised onto transparent huge pages and its
    tail off them; a plain torch.empty where madvise has no such advice."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE  # mmap's offsets are from the mapping's (page-aligned) start
    huge = nbytes // HUGE_PAGE * HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, start, huge)
    tail = (start + huge, nbytes - huge)
    if tail[1] > 0:
        mapping.madvise(mmap.MADV_NOHUGEPAGE, *tail)
    return whole[start:start + nbytes]


def join_on_huge_pages(parts: list[torch.Tensor]) -> torch.Tensor:
    """The uint8 `parts` of one weight as one tensor: from MIN_HUGE_BYTES written once into
    huge_page_tensor's memory; below it as torch.cat makes it, and a single part as it is (no
    copy)."""
    nbytes = sum(part.numel() for part in parts)
    if nbytes < MIN_HUGE_BYTES:
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    joined = huge_page_tensor(nbytes)
    torch.cat(parts, out=joined)
    return joined
