"""The acceptance rule of speculative decoding, for point-mass proposals.

Standard speculative sampling accepts a proposed token x with probability min(1, p(x)/q(x)) and,
on rejection, samples from norm(max(0, p - q)). Every proposer here proposes a point mass:
q(x) = 1 for the token given its context (n-gram lookup, and a draft model, which proposes its
argmax greedily: draft.py). Then x is accepted with probability p(x), and on rejection the
replacement is drawn from p with x removed, renormalized. Drawing y ~ p (the target's
distribution after penalties, temperature, top-k/p, grammar masks, exactly as without
speculation) and accepting x iff y == x has the same law: P(accept) = p(x), and given y != x, y
is distributed as p without x. So the engine samples the target at every verified position and
keeps the longest prefix of proposals equal to the samples, then the first sample that differs
(or the bonus sample after the last proposal).
Greedy is the special case: exact prefix match against the argmax.

So with either proposer the output distribution is exactly the target's, whatever the draft
model is: a poor draft only lowers the acceptance rate. (A draft that sampled from its own
distribution q would need the ratio test with q; the greedy draft needs none.)
"""
from __future__ import annotations

from collections.abc import Sequence


def num_accepted(proposed: Sequence[int], sampled: Sequence[int]) -> int:
    """How many proposals the target's samples confirm: the length of their common prefix.
    `sampled` has one more entry than `proposed` (the position after the last proposal); the
    tokens a step produces are sampled[:num_accepted + 1]."""
    assert len(sampled) == len(proposed) + 1, (proposed, sampled)
    count = 0
    for draft, target in zip(proposed, sampled):
        if draft != target:
            break
        count += 1
    return count
