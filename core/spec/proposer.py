"""The proposer interface: what a source of speculative tokens gives the scheduler.

A proposer sees a request (its prompt and output token ids) and returns up to `max_tokens`
tokens it expects the target model to produce next. N-gram lookup (ngram.py) is one; a draft
model or EAGLE/Medusa heads are others: they hold per-request state, so the speculator tells
them when a request ends (`forget`). Proposals are point masses (a token, not a distribution):
acceptance.py says why that makes sampling the target at each position exact rejection sampling.
"""
from __future__ import annotations

from typing import Protocol

from ..request import Request


class Proposer(Protocol):
    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """At most `max_tokens` (>= 1) proposed next tokens; [] when it has nothing to offer."""

    def forget(self, request_id: str) -> None:
        """The request ended: drop what is kept for it."""
