"""The engine's speculator, built once at start: the configured proposer (n-gram lookup, or the
draft model loaded on the engine's backend) and the check of constrained requests' proposals."""
from __future__ import annotations

from ..backend import Backend
from ..config import EngineConfig
from ..loader import LoadedModel
from .proposer import ProposalCheck
from .speculator import Speculator


def build_speculator(config: EngineConfig, backend: Backend, target: LoadedModel, target_num_blocks: int,
                     grammar: ProposalCheck, tokenizer=None) -> Speculator | None:
    """None when speculative decoding is off. A draft model (method "draft") is loaded here;
    check it first with draft.check_draft_model, before the target loads."""
    spec = config.speculative
    if not spec.enabled:
        return None
    proposer = None
    if spec.method == "draft":
        from .draft import DraftModelProposer

        proposer = DraftModelProposer.load(config, backend, target, target_num_blocks)
    return Speculator(spec, proposer, grammar, row_cost=backend.capabilities().decode_row_cost)
