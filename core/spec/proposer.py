"""The proposer interface: what a source of speculative tokens gives the scheduler.

The scheduler asks once per step, for all of the step's speculating decodes together: each is
a request (its prompt and output token ids) and the most tokens it may verify, and the proposer
returns, in order, the tokens it expects the target model to produce next for each ([] where it
has nothing to offer). Asking for the whole batch at once lets a model proposer run one forward
per proposed position for every request (draft.py), while n-gram lookup (ngram.py) simply goes
request by request. Proposers hold per-request state, so the speculator tells them when a
request ends (`forget`). Proposals are point masses (a token, not a distribution): acceptance.py
says why that makes sampling the target at each position exact rejection sampling.

A `ProposalCheck` (the engine's constrained requests, core/grammar/constrained.py) then keeps
only the proposals a request's grammar allows.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..scheduling.request import Request

# One speculating decode: the request and the most tokens it may propose (>= 1) this step.
ProposalSlot = tuple[Request, int]


class Proposer(Protocol):
    def propose(self, slots: Sequence[ProposalSlot]) -> list[list[int]]:
        """For each slot, at most its number of proposed next tokens ([] for none), in order."""

    def forget(self, request_id: str) -> None:
        """The request ended: drop what is kept for it."""


class ProposalCheck(Protocol):
    def check_proposals(self, request_id: str, proposals: Sequence[int]) -> list[int]:
        """The longest prefix of `proposals` the request may verify."""
