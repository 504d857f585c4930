"""Paged KV cache bookkeeping (pure Python): the block pool and the per-request manager. Beside
them, not imported here: sizing.py (pure Python, the cache's size) and quantized.py (torch, the
rows of a quantized cache, --kv-cache-dtype)."""
from .block_pool import RESERVED_BLOCK_ID, BlockPool, NoFreeBlocksError
from .kv_cache_manager import KVCacheManager, cdiv

__all__ = ["RESERVED_BLOCK_ID", "BlockPool", "KVCacheManager", "NoFreeBlocksError", "cdiv"]
