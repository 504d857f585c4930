"""scheduler -> runner: what to compute in one step."""
from __future__ import annotations

from dataclasses import dataclass, field

from .encoder_budget import rows_started


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
    # Speculative decoding (core/spec): the last num_draft_tokens of token_ids are proposed
    # tokens after the request's last one, verified this step; the runner returns the logits of
    # every position from the request's last token on (num_draft_tokens + 1 rows).
    num_draft_tokens: int = 0
    # A pooling request (core/pooling): it samples nothing; the runner hands back the hidden
    # states of its tokens in this step, which the engine's pooler reduces into its embedding.
    pools: bool = False
    # The LoRA adapter its tokens run with (core/lora; Request.lora_name); None: the base model
    lora_name: str | None = None
    # The images (core/multimodal ImageSpan) whose placeholder tokens this step computes some of:
    # the runner writes their encoder output over those tokens' input embeddings.
    images: tuple = ()
    # How far the positions of its first token on are shifted by the images before them that it
    # does not touch (core/multimodal/positions.py: M-RoPE's image grids; 0 without grids): a
    # token's 1D position is its index plus this plus the deltas of `images` that end before it.
    position_shift: int = 0

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def num_logits(self) -> int:
        """Rows of logits this request gets back: 0 when it does not sample."""
        return self.num_draft_tokens + 1 if self.samples else 0

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
    # Prefix cache, over this step's admissions: tokens looked up, and found cached.
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # Partial prefix hits' slots to copy before the step computes (core/kv KVCopy; every shard)
    kv_copies: tuple = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepDraft:
    """One step while the scheduler builds it (becomes a SchedulerOutput)."""

    budget: int  # tokens left
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted_ids: list[str] = field(default_factory=list)
    blocked: bool = False  # a running request got no room: admit nobody
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    encoder_rows: int = 0  # image embedding rows the step's chunks start encoding (encoder_budget.py)

    def add(self, scheduled: ScheduledRequest) -> None:
        self.scheduled[scheduled.request_id] = scheduled
        self.budget -= scheduled.num_new_tokens
        if scheduled.images:
            self.encoder_rows += rows_started(scheduled.images, scheduled.num_computed_tokens,
                                              scheduled.num_new_tokens)

    def output(self, kv_copies: tuple = ()) -> SchedulerOutput:
        # Decodes (one new token) first, then longer chunks; stable within each group.
        scheduled = sorted(self.scheduled.values(), key=lambda s: s.num_new_tokens != 1)
        return SchedulerOutput(scheduled=tuple(scheduled), preempted_ids=tuple(self.preempted_ids),
                               num_prefix_queried_tokens=self.num_prefix_queried_tokens,
                               num_prefix_hit_tokens=self.num_prefix_hit_tokens, kv_copies=kv_copies)
