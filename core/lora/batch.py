"""A step's LoraBatch (core/backend_contract.py) from each token's adapter slot, and its rows.

The runner lays a step out request after request, so each request's tokens are one run of one
slot: segments are those runs (merged where neighbours share a slot), tokens of the base model
(slot -1) in none. A step with no adapter token has no LoraBatch (None): the layers then add
nothing and cost nothing more.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backend_contract import LoraBatch

BASE = -1  # the slot of a token of the base model


def lora_batch(token_slots: Sequence[int], device: torch.device) -> LoraBatch | None:
    """The LoraBatch of tokens with these slots (in order), or None when none has an adapter."""
    segments: list[tuple[int, int, int]] = []
    start = 0
    for index in range(1, len(token_slots) + 1):
        if index == len(token_slots) or token_slots[index] != token_slots[start]:
            if token_slots[start] != BASE:
                segments.append((start, index, token_slots[start]))
            start = index
    if not segments:
        return None
    return LoraBatch(torch.tensor(token_slots, dtype=torch.int32, device=device), tuple(segments))


def slice_batch(batch: LoraBatch | None, start: int, count: int) -> LoraBatch | None:
    """The LoraBatch of rows [start, start + count) of `batch`'s tokens (renumbered from 0)."""
    if batch is None:
        return None
    stop = start + count
    segments = tuple((max(a, start) - start, min(b, stop) - start, slot) for a, b, slot in batch.segments
                     if a < stop and b > start)
    if not segments:
        return None
    return LoraBatch(batch.token_slots[start:stop], segments)
