"""Speculative decoding: proposers, the per-request acceptance tracking, the acceptance rule.

The scheduler asks a `Speculator` for each decoding request's proposed tokens and schedules
them after its last token as one multi-token query; the runner returns logits at every query
position; the engine samples the target model at each position and keeps the longest prefix
of proposals the samples agree with, plus the sample after it (`acceptance.py`)."""
from .acceptance import num_accepted
from .adaptive import AcceptanceTracker
from .ngram import NgramProposer
from .proposer import Proposer
from .speculator import Speculator, SpeculationStats

__all__ = ["AcceptanceTracker", "NgramProposer", "Proposer", "Speculator", "SpeculationStats", "num_accepted"]
