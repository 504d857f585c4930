"""Paged KV cache bookkeeping (pure Python): the block pool and the per-request manager."""
from .block_pool import RESERVED_BLOCK_ID, BlockPool, NoFreeBlocksError
from .kv_cache_manager import KVCacheManager, cdiv

__all__ = ["RESERVED_BLOCK_ID", "BlockPool", "KVCacheManager", "NoFreeBlocksError", "cdiv"]
