"""How large a KV cache that lives in host memory (the CPU backend's) is, and the line that says so.

The cache is sized from what the configuration needs, never from the memory that happens to
be free. (It used to take 30% of the free memory: 140k tokens, 6.4 GB in float32, for the
135M default model, which then was the OOM killer's choice; a second server started a minute
later got 1,680 tokens, and nothing said so.) The rule, decided here once:

- `CacheConfig.num_blocks` (--max-batch-total-tokens, --num-kv-blocks) when given, as it is;
- else what the configuration can hold at once (`usable_tokens`: max_num_seqs x max_model_len),
  at most the bytes DEFAULT_KV_TOKENS tokens take in the model's dtype, or one whole-context
  request if that is more (as vLLM and TGI insist, a request of the served context must fit), or,
  with `kv_cache_memory` (--kv-cache-memory), at most that many bytes instead; either budget
  holds about 3.8x the tokens in a quantized cache (--kv-cache-dtype int8 or fp8: one byte a
  value and a 4-byte scale a row, against float32's four a value);
- a cache that does not fit in the memory available is refused, in one line (check_fits).

Peers: llama-server holds one context (-c, 4,096 tokens by default in most builds; 0 = the
model's) shared by its slots; vLLM on the CPU takes a fixed KV space (VLLM_CPU_KVCACHE_SPACE,
4 GiB by default). 16,384 tokens is four llama-server contexts, or two whole 8k-context
requests of the default model, whose cache is then 0.76 GB in float32 (0.38 GB in bfloat16;
the cache has the model's dtype unless --kv-cache-dtype says otherwise; in int8 or fp8 the same
0.76 GB holds 61,680 tokens). The pages are handed out on first touch, so the RSS grows
to that as the blocks are used. Device backends keep their fraction-of-memory rule.

Pure Python: the command line parses --kv-cache-memory with parse_memory_size before torch
is imported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..config import CacheConfig
from ..errors import BackendCapabilityError

DEFAULT_KV_TOKENS = 16384
GB = 10**9  # the log line's unit, as `free -g` and the issue report memory

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class KVCacheTooLarge(BackendCapabilityError):
    """The KV cache the configuration needs does not fit in the memory available."""


def parse_memory_size(text: str) -> int:
    """Bytes of "4GiB", "512MB", "1.5G", "4096": KB/MB/GB are powers of ten, KiB/MiB/GiB and the
    bare K/M/G powers of two (as docker's --memory); raises ValueError for anything else."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (e.g. 4GiB, 512MB, 1073741824)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return size


def with_usable_tokens(cache: CacheConfig, max_num_seqs: int, max_model_len: int,
                       model_dtype_block_bytes: int | None = None) -> CacheConfig:
    """`cache` knowing what the configuration can hold: max_num_seqs x max_model_len at once,
    max_model_len in one request; and what a block takes in the model's dtype (the automatic
    budget's unit, which a quantized cache packs into fewer bytes)."""
    return replace(cache, usable_tokens=max_num_seqs * max_model_len, context_tokens=max_model_len,
                   model_dtype_block_bytes=model_dtype_block_bytes)


def without_bytes(cache: CacheConfig, nbytes: int) -> CacheConfig:
    """`cache` with `nbytes` that something else holds (LoRA's adapter stacks, core/lora) taken off
    its --kv-cache-memory budget; the token rule and a configured block count are left as they are."""
    if cache.kv_cache_memory is None or nbytes <= 0:
        return cache
    return replace(cache, kv_cache_memory=max(1, cache.kv_cache_memory - nbytes))


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens`, plus the reserved block 0."""
    return -(-tokens // block_size) + 1


def blocks_from_configuration(bytes_per_block: int, cache: CacheConfig) -> int:
    """The automatic size of a host-memory cache (the module's rule), in blocks; at least 2."""
    usable = cache.usable_tokens
    if cache.kv_cache_memory is not None:
        blocks = cache.kv_cache_memory // bytes_per_block
        if usable is not None:
            blocks = min(blocks, blocks_for_tokens(usable, cache.block_size))
    else:
        limit = blocks_for_tokens(max(DEFAULT_KV_TOKENS, cache.context_tokens or 0), cache.block_size)
        if cache.model_dtype_block_bytes is not None:  # those blocks' bytes in the model's dtype, in this cache's
            limit = (limit - 1) * cache.model_dtype_block_bytes // bytes_per_block + 1
        blocks = limit if usable is None else min(limit, blocks_for_tokens(usable, cache.block_size))
    return max(2, min(cache.max_auto_blocks, blocks))


@dataclass(frozen=True)
class KVCacheSize:
    """One allocated cache: its blocks, their size in tokens, its bytes over every layer."""

    num_blocks: int
    block_size: int
    nbytes: int
    dtype: str = ""

    @property
    def tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size  # block 0 is reserved

    def describe(self) -> str:
        dtype = f", {self.dtype}" if self.dtype else ""
        return (f"KV cache: {self.nbytes / GB:.2f} GB, {self.tokens:,} tokens "
                f"({self.num_blocks:,} blocks of {self.block_size}{dtype})")


def check_fits(size: KVCacheSize, available_bytes: int) -> None:
    """Refuses, in one line, a cache larger than the memory available."""
    if size.nbytes > available_bytes:
        raise KVCacheTooLarge(
            f"the KV cache of {size.tokens:,} tokens needs {size.nbytes / GB:.2f} GB, more than the "
            f"{available_bytes / GB:.2f} GB of memory available; ask for fewer tokens "
            "(--max-batch-total-tokens, --kv-cache-memory or --max-model-len) or free memory")
