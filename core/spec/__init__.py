"""Speculative decoding: proposers, the per-request acceptance tracking, the acceptance rule.

The scheduler asks a `Speculator` once per step for the proposed tokens of all its decodes and
schedules each one's after its last token as one multi-token query; the runner returns logits at
every query position; the engine samples the target model at each position and keeps the longest
prefix of proposals the samples agree with, plus the sample after it (`acceptance.py`).

Proposers (`proposer.py`): n-gram lookup (`ngram.py`) and a draft model (`draft.py`, which
imports the loader and the runner, so it is not imported here: the engine builds it through
`build.py`). Constrained requests' proposals are checked against their grammars
(core/grammar/constrained.py) through the speculator."""
from .acceptance import num_accepted
from .adaptive import AcceptanceTracker
from .ngram import NgramProposer
from .proposer import ProposalCheck, ProposalSlot, Proposer
from .speculator import Speculator, SpeculationStats

__all__ = ["AcceptanceTracker", "NgramProposer", "ProposalCheck", "ProposalSlot", "Proposer", "Speculator",
           "SpeculationStats", "num_accepted"]
