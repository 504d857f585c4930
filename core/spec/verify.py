"""How a step's sampled rows map to its requests when some verify proposed tokens, and the
rewinding of a seeded request's generator to the draws of the tokens it keeps."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheduling.output import SchedulerOutput
from .acceptance import num_accepted


@dataclass(frozen=True)
class VerifyPlan:
    """How one step's sampled rows map to its requests: a request that verifies k proposed
    tokens has k + 1 consecutive rows (core/spec/acceptance.py), any other one row."""

    request_ids: tuple[str, ...]
    drafts: tuple[tuple[int, ...], ...]  # each request's proposed tokens (() for most)
    starts: tuple[int, ...]  # each request's first row
    row_request_ids: tuple[str, ...]  # the request of each row

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput, request_ids: tuple[str, ...]) -> VerifyPlan:
        by_id = {s.request_id: s for s in scheduler_output.scheduled if s.num_draft_tokens}
        drafts = tuple(by_id[rid].draft_token_ids if rid in by_id else () for rid in request_ids)
        starts, row_ids, row = [], [], 0
        for rid, draft in zip(request_ids, drafts):
            starts.append(row)
            row_ids.extend([rid] * (len(draft) + 1))
            row += len(draft) + 1
        return cls(tuple(request_ids), drafts, tuple(starts), tuple(row_ids))

    @property
    def drafts_by_request(self) -> dict[str, tuple[int, ...]]:
        """The proposed tokens of each request that verifies some."""
        return {rid: drafts for rid, drafts in zip(self.request_ids, self.drafts) if drafts}

    def accepted(self, index: int, sampled: list[int]) -> list[int]:
        """The tokens request `index` produces: its accepted proposals and the sample after them."""
        drafts, first = self.drafts[index], self.starts[index]
        targets = sampled[first:first + len(drafts) + 1]
        return targets[:num_accepted(drafts, targets) + 1]


def rewind(generator: torch.Generator, state: torch.Tensor, num_draws: int, vocab_size: int) -> None:
    """Put `generator` where it would be after `num_draws` rows of sampling noise from `state`
    (core/execution/sampling.py draws one vocabulary-wide row of exponentials per sampled position)."""
    generator.set_state(state)
    noise = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_draws):
        noise.exponential_(generator=generator)
