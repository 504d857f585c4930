"""The compile cache: futures of compiled grammars, least recently used first out, bounded
both in entries and in bytes (each compiled grammar's serialized size). A future still
compiling is never evicted and counts no bytes until it resolves; a failure (an invalid
spec) is cached too, at no bytes. Not thread-safe: the service holds its lock around it."""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future

from .spec import GrammarSpec


class GrammarCache:
    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max(1, max_entries)
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._sizes: dict[GrammarSpec, int] = {}

    def get(self, spec: GrammarSpec) -> Future | None:
        future = self._entries.get(spec)
        if future is not None:
            self._entries.move_to_end(spec)
        return future

    def add(self, spec: GrammarSpec, future: Future) -> None:
        """A new pending entry (its size comes with `resolved`)."""
        self._entries[spec] = future
        self._evict()

    def resolved(self, spec: GrammarSpec, future: Future, nbytes: int) -> None:
        """`future` (still the entry of `spec`) resolved to something of `nbytes`."""
        if self._entries.get(spec) is not future:
            return  # evicted or dropped meanwhile
        self._sizes[spec] = nbytes
        self.nbytes += nbytes
        self._evict()

    def drop(self, spec: GrammarSpec, future: Future) -> None:
        """Forget `spec` if `future` is still its entry (a timeout: never cached)."""
        if self._entries.get(spec) is future:
            del self._entries[spec]
            self.nbytes -= self._sizes.pop(spec, 0)

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            oldest = next((s for s, f in self._entries.items() if f.done()), None)
            if oldest is None:
                return  # all pending: they count no bytes, and resolve soon
            del self._entries[oldest]
            self.nbytes -= self._sizes.pop(oldest, 0)

    def __contains__(self, spec: GrammarSpec) -> bool:
        return spec in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def pending(self) -> list[Future]:
        return [f for f in self._entries.values() if not f.done()]
