"""When to prefill, for backends that cannot mix prefill and decode in one step
(SchedulerConfig.mixed_prefill_decode=False). Pure Python.

TGI's router (its non-chunking mode) decodes the running batch and, between decode
steps, adds a prefill of waiting requests when
- the batch is empty, or
- `max_waiting_tokens` tokens have been generated since the last prefill (its
  `waiting_tokens` counter is 1 after a prefill and grows by one per decode step), or
- the waiting requests number at least floor(batch size * `waiting_served_ratio`).
Its loop decodes the batch after every prefill it adds, so two prefill steps never
follow each other while some request can decode; here the same holds, which also
keeps a long prompt, chunked over several prefill steps, from stalling the streams.
"Waiting" counts queued requests plus running ones whose prompt is still being
computed; "batch size" counts the requests that can decode.
"""
from __future__ import annotations


class PrefillPolicy:
    def __init__(self, waiting_served_ratio: float, max_waiting_tokens: int):
        if waiting_served_ratio < 0:
            raise ValueError(f"waiting_served_ratio must be >= 0, got {waiting_served_ratio}")
        if max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_tokens must be >= 1, got {max_waiting_tokens}")
        self.waiting_served_ratio = waiting_served_ratio
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting_tokens = 1  # TGI's counter: decode steps since the last prefill step, plus one
        self.last_step_was_prefill = False

    def takes_prefill(self, num_decodable: int, num_prefill_candidates: int) -> bool:
        """Whether the next step should be a prefill step."""
        if num_prefill_candidates == 0:
            return False
        if num_decodable == 0:
            return True
        if self.last_step_was_prefill:
            return False
        if self.waiting_tokens >= self.max_waiting_tokens:
            return True
        return num_prefill_candidates >= int(num_decodable * self.waiting_served_ratio)

    def record(self, was_prefill: bool) -> None:
        """Note the kind of step just scheduled."""
        self.last_step_was_prefill = was_prefill
        self.waiting_tokens = 1 if was_prefill else self.waiting_tokens + 1
