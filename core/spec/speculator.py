"""The speculator: which tokens each decoding request proposes this step, and the counts.

The scheduler asks `propose(request, limit)` for each decode it schedules and reports each
verified step's outcome with `record`; the engine ends a request's state with `forget`. The
one decision of whether a request speculates is made here: not for constrained requests (the
grammar matcher would have to be advanced and rolled back over the proposals; they decode as
without speculation), not while its acceptance tracker pauses it, and never past its length.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import SpeculativeConfig
from ..request import Request
from .adaptive import AcceptanceTracker
from .ngram import NgramProposer
from .proposer import Proposer


@dataclass
class SpeculationStats:
    """Totals over the engine's life (read by the metrics after each step)."""

    num_proposed: int = 0  # proposed tokens verified
    num_accepted: int = 0  # of them, accepted
    num_verify_steps: int = 0  # request-steps that verified at least one proposal


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        if config.num_speculative_tokens < 1:
            raise ValueError("a speculator needs num_speculative_tokens >= 1")
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(f"unknown speculative method {config.method!r}")
            proposer = NgramProposer(config.ngram_min, config.ngram_max, config.ngram_window)
        self.config = config
        self.proposer = proposer
        self.stats = SpeculationStats()
        self._trackers: dict[str, AcceptanceTracker] = {}

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to min(k, limit) proposed tokens for a decoding request (limit: what its length
        and the step's budget leave)."""
        limit = min(limit, self.config.num_speculative_tokens)
        if limit < 1 or request.sampling_params.grammar is not None:
            return []
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            tracker = self._trackers[request.request_id] = AcceptanceTracker(self.config.min_acceptance)
        if self.config.adaptive and not tracker.wants_proposals():
            return []
        return self.proposer.propose(request, limit)

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self.stats.num_proposed += num_proposed
        self.stats.num_accepted += num_accepted
        self.stats.num_verify_steps += 1
        tracker = self._trackers.get(request_id)
        if tracker is not None:
            tracker.record(num_proposed, num_accepted)

    def forget(self, request_id: str) -> None:
        self._trackers.pop(request_id, None)
        self.proposer.forget(request_id)
