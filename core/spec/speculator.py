"""The speculator: which tokens each decoding request proposes this step, and the counts.

The scheduler asks `propose(slots)` once per step for all the decodes it may schedule (each
with the most tokens its length and the step's budget leave) and reports each verified step's
outcome with `record`; the scheduler ends a request's state with `forget`. The one decision of
whether and how much a request speculates is made here: as many tokens as pay for their rows
at this step's size (adaptive.py, from its measured acceptance and what a row costs, which
the engine's decode steps teach `cost`: core/spec/cost.py; all k of them with adaptive off),
never past its length, and, for a constrained request, only when the engine gave a
`ProposalCheck` (its grammars): the proposals are then cut at the first token the grammar
rejects, or after the one that completes it. The proposer (n-gram lookup, or a draft model) is
asked once for every request that speculates.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import SpeculativeConfig
from ..scheduling.request import Request
from .adaptive import AcceptanceTracker, SharedAcceptance, proposal_lengths
from .cost import DEFAULT_ROW_COST, StepCost
from .ngram import NgramProposer
from .proposer import ProposalCheck, ProposalSlot, Proposer


@dataclass
class SpeculationStats:
    """Totals over the engine's life (read by the metrics after each step)."""

    num_proposed: int = 0  # proposed tokens verified
    num_accepted: int = 0  # of them, accepted
    num_verify_steps: int = 0  # request-steps that verified at least one proposal
    num_cut_by_grammar: int = 0  # proposed tokens dropped before verification: a grammar refused them


class Speculator:
    """`proposer`: None for the configured n-gram lookup; a draft model's (core/spec/draft.py)
    is built by the engine, which has the backend. `grammar`: None, constrained requests do
    not speculate."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None,
                 grammar: ProposalCheck | None = None, row_cost: float = DEFAULT_ROW_COST):
        if config.num_speculative_tokens < 1:
            raise ValueError("a speculator needs num_speculative_tokens >= 1")
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(f"speculative method {config.method!r} needs its proposer built by the engine")
            proposer = NgramProposer(config.ngram_min, config.ngram_max, config.ngram_window)
        self.config = config
        self.proposer = proposer
        self.grammar = grammar
        self.stats = SpeculationStats()
        self.cost = StepCost(row_cost)  # from the backend's declared row cost; fed by the engine's steps
        self.shared = SharedAcceptance()
        self._trackers: dict[str, AcceptanceTracker] = {}

    def propose(self, slots: Sequence[ProposalSlot]) -> dict[str, list[int]]:
        """Proposed tokens of the decodes that speculate this step, by request id: up to
        min(k, limit) each (limit: what its length and the step's budget leave), as many as
        pay for their rows at this step's size (all decodes: `slots`)."""
        allowed = [(request, min(limit, self.config.num_speculative_tokens)) for request, limit in slots
                   if limit >= 1 and (request.sampling_params.grammar is None or self.grammar is not None)]
        trackers = [self._tracker(request) for request, _ in allowed]
        if self.config.adaptive:
            lengths = proposal_lengths([t.rate for t in trackers], [most for _, most in allowed], len(slots),
                                       self.cost.row_cost, self.config.min_acceptance)
            for tracker, length in zip(trackers, lengths):
                if not length:
                    tracker.idle()
            allowed = [(request, length) for (request, _), length in zip(allowed, lengths) if length]
        if not allowed:
            return {}
        proposals = {}
        for (request, _), tokens in zip(allowed, self.proposer.propose(allowed)):
            if tokens and request.sampling_params.grammar is not None:
                checked = self.grammar.check_proposals(request.request_id, tokens)
                self.stats.num_cut_by_grammar += len(tokens) - len(checked)
                tokens = checked
            if tokens:
                proposals[request.request_id] = tokens
        return proposals

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step's query rows and time (the engine's whole step): what a row costs."""
        self.cost.observe(rows, seconds)

    def _tracker(self, request: Request) -> AcceptanceTracker:
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            tracker = self._trackers[request.request_id] = AcceptanceTracker(self.shared)
        return tracker

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
