"""The Kirchenbauer et al. (2023) watermark that TGI's `watermark` parameter asks for.

At each step a pseudo-random "green list" of gamma * vocab tokens, seeded by the
previous token, gets +delta added to its logits. TGI draws the list with
`randperm` seeded per row; here membership is a keyed integer hash of
(previous token, candidate token), which is the same scheme (a PRF of the
previous token partitions the vocabulary) computed for the whole batch in one
tensor expression. `detect` recomputes the lists and returns the z-score.
"""
from __future__ import annotations

import math

import torch

GAMMA = 0.5  # fraction of the vocabulary that is green (TGI's default)
DELTA = 2.0  # logit bonus of green tokens (TGI's default)
HASH_KEY = 15485863  # TGI's hash key (the millionth prime)
_MASK = (1 << 31) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer mixer (xorshift-multiply), exact in int64."""
    x = x & _MASK
    x = ((x >> 15) ^ x) * 0x2C1B3C6D & _MASK
    x = ((x >> 12) ^ x) * 0x297A2D39 & _MASK
    return (x >> 15) ^ x


def green_mask(previous_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R] previous tokens -> [R, vocab] bool: which candidates are green."""
    device = previous_token_ids.device
    seeds = _mix(previous_token_ids.long() * HASH_KEY)
    candidates = torch.arange(vocab_size, device=device, dtype=torch.long)
    hashed = _mix(seeds.unsqueeze(1) * 0x5BD1E995 + candidates.unsqueeze(0))
    return hashed < int(GAMMA * (_MASK + 1))


def apply_watermark(logits: torch.Tensor, rows: list[int], previous_token_ids: list[int]) -> torch.Tensor:
    """Adds DELTA to the green tokens of the given rows (in place on a copy's rows)."""
    prev = torch.tensor(previous_token_ids).to(logits.device, non_blocking=True)
    bonus = green_mask(prev, logits.shape[-1]).to(logits.dtype) * DELTA
    logits[rows] += bonus
    return logits


def detect(token_ids: list[int], vocab_size: int) -> float:
    """z-score of the green-token count over token_ids[1:] (each scored against the
    token before it). Around 0 for text without the watermark; > 4 is strong evidence."""
    if len(token_ids) < 2:
        return 0.0
    ids = torch.tensor(token_ids, dtype=torch.long)
    green = green_mask(ids[:-1], vocab_size).gather(1, ids[1:].unsqueeze(1)).squeeze(1)
    n = len(token_ids) - 1
    return (green.sum().item() - GAMMA * n) / math.sqrt(n * GAMMA * (1 - GAMMA))
