"""Static shape buckets for compiled (XLA, Neuron) runners. No torch, no vendor import.

A step of T tokens over R requests is padded to the smallest token bucket >= T and the
smallest request bucket >= R; the block table always has max_blocks columns (enough for
max_model_len). So the runner compiles at most len(tokens) * len(requests) graphs, all at
warm-up, and never another one.
"""
from __future__ import annotations

from dataclasses import dataclass


def powers_of_two(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest, 2*smallest, ... and finally largest itself (the cap is always a bucket)."""
    sizes, size = [], max(1, smallest)
    while size < largest:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (largest,)


def smallest_fit(buckets: tuple[int, ...], n: int, what: str) -> int:
    for size in buckets:
        if size >= n:
            return size
    raise ValueError(f"{n} {what} exceed the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class ShapeBuckets:
    tokens: tuple[int, ...]  # padded flat token counts, ascending
    requests: tuple[int, ...]  # padded request counts, ascending
    max_blocks: int  # block-table columns of every step

    @classmethod
    def for_limits(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                   block_size: int, min_tokens: int = 16) -> ShapeBuckets:
        tokens = powers_of_two(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
        requests = powers_of_two(1, min(max_num_seqs, max_num_batched_tokens))
        return cls(tokens, requests, -(-max_model_len // block_size))

    def pad_tokens(self, n: int) -> int:
        return smallest_fit(self.tokens, n, "tokens")

    def pad_requests(self, n: int) -> int:
        return smallest_fit(self.requests, n, "requests")

    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Every (tokens, requests) pair a step can pad to: a step of r real requests has at
        least r tokens, so request bucket r is reachable from token bucket t when the fewest
        requests it holds (one more than the bucket below) fit in t tokens."""
        pairs = []
        for i, r in enumerate(self.requests):
            fewest = self.requests[i - 1] + 1 if i else 1
            pairs += [(t, r) for t in self.tokens if t >= fewest]
        return tuple(pairs)
