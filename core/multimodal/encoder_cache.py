"""Image embeddings by content hash, so that an image is encoded once however its prompt is
chunked, and once for every request that sends it while it stays cached.

Keyed by ImageSpan.content_hash (ImageData.key: the bytes' hash, and whether it is split).
Bounded by the embedding rows it holds (least recently used out first). It is only a cache: every
scheduled chunk carries its images' spans (ScheduledRequest.images) and their pixels (made when
first needed, pixels.py), so an evicted image is encoded again, never missing."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch


class EncoderCache:
    def __init__(self, max_rows: int = 1 << 15):
        self.max_rows = max_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.num_encoded = 0  # images encoded over its life (tests, metrics)

    def get(self, content_hash: str, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        embeddings = self._entries.get(content_hash)
        if embeddings is not None:
            self._entries.move_to_end(content_hash)
            return embeddings
        embeddings = encode()
        self.num_encoded += 1
        self._entries[content_hash] = embeddings
        self._rows += embeddings.shape[0]
        while self._rows > self.max_rows and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self._rows -= dropped.shape[0]
        return embeddings
