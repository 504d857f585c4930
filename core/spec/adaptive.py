"""How many tokens each speculating request proposes in a step: as many as pay for their rows.

Acceptance is modelled per position: each proposal is accepted with probability `a` given the
ones before it were (a geometric run), so the j-th proposal yields a**j tokens on average. A
request's `a` is estimated from its own verify steps (`AcceptanceTracker`: accepted proposals
are successes, the first rejected one a failure, counted with exponential forgetting so that a
request that starts or stops copying its input is followed within a few steps), around the
speculator's estimate over all requests, which is where a new request starts.

One more row in a step costs `row_cost` (core/spec/cost.py: one row's time over the step's
fixed time). A step of `rows` rows yielding `tokens` tokens costs 1 + row_cost * rows, so a
proposal of expected value v raises the step's tokens per second exactly when
v > row_cost * tokens / (1 + row_cost * rows); it is made when v beats that by 10%. `proposal_lengths` adds proposals in order of
value while that holds, starting from the step's decodes (one row and one token each): at one
request on a CPU a well-accepted request proposes several tokens; as the batch grows the bar
rises, and at batches where a row costs as much as it brings, nobody proposes and the step is
the plain one. `min_acceptance` is a floor under a request's estimate below which it never
proposes; a request that is not proposing drifts back towards the shared estimate, so it tries
again later.
"""
from __future__ import annotations

from collections.abc import Sequence

_PRIOR_WEIGHT = 2.0  # pseudo-observations of the shared estimate in a request's own
_FORGET = 0.8  # weight kept by a request's older outcomes at each verify step
_IDLE_FORGET = 0.95  # ... at each step it does not propose in (towards the shared estimate)
_SHARED_FORGET = 0.995  # the shared estimate's forgetting, per verify step of any request
_INITIAL = 0.6  # the shared estimate before any verify step
# A proposal must beat its rows' cost by this much: what the line leaves out (a request's
# acceptance is bursty, not geometric; rows' costs outside the step) falls on the side of fewer rows.
_MARGIN = 1.1


class SharedAcceptance:
    """The per-position acceptance over all requests (a new request's starting estimate)."""

    def __init__(self) -> None:
        self.successes, self.failures = _INITIAL * 10, (1 - _INITIAL) * 10

    def record(self, successes: int, failures: int) -> None:
        self.successes = _SHARED_FORGET * self.successes + successes
        self.failures = _SHARED_FORGET * self.failures + failures

    @property
    def rate(self) -> float:
        return self.successes / (self.successes + self.failures)


class AcceptanceTracker:
    __slots__ = ("shared", "successes", "failures")

    def __init__(self, shared: SharedAcceptance):
        self.shared = shared
        self.successes = self.failures = 0.0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        failure = 1 if num_accepted < num_proposed else 0
        self.successes = _FORGET * self.successes + num_accepted
        self.failures = _FORGET * self.failures + failure
        self.shared.record(num_accepted, failure)

    def idle(self) -> None:
        """A step without proposals: the request's own outcomes weigh a little less."""
        self.successes *= _IDLE_FORGET
        self.failures *= _IDLE_FORGET

    @property
    def rate(self) -> float:
        prior = self.shared.rate * _PRIOR_WEIGHT
        return (self.successes + prior) / (self.successes + self.failures + _PRIOR_WEIGHT)


def proposal_lengths(rates: Sequence[float], limits: Sequence[int], num_decodes: int, row_cost: float,
                     floor: float = 0.0) -> list[int]:
    """How many tokens each request proposes: the proposals whose expected tokens beat what
    their rows cost at this step's size, most valuable first. `rates`: each request's
    per-position acceptance; `limits`: the most each may propose; `num_decodes`: the step's
    decodes (speculating or not), one row and one token each."""
    lengths = [0] * len(rates)
    candidates = sorted(((rate ** j, i) for i, (rate, limit) in enumerate(zip(rates, limits))
                         if rate >= floor and rate > 0 for j in range(1, limit + 1)), reverse=True)
    rows = tokens = float(num_decodes)
    for value, i in candidates:  # a request's values fall with j, so each takes its proposals in order
        if value <= _MARGIN * row_cost * tokens / (1 + row_cost * rows):
            break
        lengths[i] += 1
        rows += 1
        tokens += value
    return lengths
