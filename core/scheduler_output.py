"""scheduler -> runner: what to compute in one step."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]  # the tokens computed this step
    num_computed_tokens: int  # position of token_ids[0] in the request
    block_ids: tuple[int, ...]  # every KV block of the request, after this step's allocation
    samples: bool  # this step reaches the request's last token, so it produces one
    # Its positions predict prompt tokens whose log-probabilities were asked for
    # (SamplingParams.prompt_logprobs): the runner returns their logits too.
    computes_prompt_logprobs: bool = False

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length once this step's tokens are written."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]  # decodes first, then prompt chunks
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
