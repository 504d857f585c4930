"""The engine's constrained requests: one matcher each, and the bitmask of its next token.

Each request's next-token row is filled right after its last token is accepted (once per
token), which also tells at once whether the grammar is complete, i.e. nothing but EOS
may follow: the request then finishes without spending a step on EOS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CompiledGrammar, GrammarMatcher, allocate_bitmask, mask_bias, token_words


@dataclass(frozen=True)
class GrammarMask:
    """The constrained rows of one step's logits and their allowed tokens."""

    rows: tuple[int, ...]  # indices into the step's sampling rows
    bitmask: torch.Tensor  # [len(rows), words] int32, on the host


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """A copy of logits with the disallowed tokens of the constrained rows at -inf."""
    device = logits.device
    bitmask = mask.bitmask if device.type == "cpu" else mask.bitmask.pin_memory().to(device, non_blocking=True)
    bias = mask_bias(bitmask, logits.shape[-1], logits.dtype)
    if len(mask.rows) == logits.shape[0]:
        return logits + bias
    index = torch.tensor(mask.rows, dtype=torch.long)
    index = index if device.type == "cpu" else index.pin_memory().to(device, non_blocking=True)
    rows = logits.index_select(0, index).add_(bias)
    return logits.index_copy(0, index, rows)


class _Constrained:
    __slots__ = ("matcher", "next_row")

    def __init__(self, matcher: GrammarMatcher, next_row: torch.Tensor):
        self.matcher = matcher
        self.next_row = next_row  # [1, words]: the tokens allowed next


class ConstrainedRequests:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._not_eos = ~token_words(eos_token_ids, vocab_size)
        self._states: dict[str, _Constrained] = {}

    def __bool__(self) -> bool:
        return bool(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, request_id: str, compiled: CompiledGrammar) -> None:
        state = _Constrained(compiled.new_matcher(), allocate_bitmask(1, self.vocab_size))
        state.matcher.fill_bitmask(state.next_row, 0)
        self._states[request_id] = state

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def mask(self, request_ids: list[str]) -> GrammarMask | None:
        """The mask of this step's constrained rows; None (and no work) if there are none."""
        if not self._states:
            return None
        rows = tuple(i for i, rid in enumerate(request_ids) if rid in self._states)
        if not rows:
            return None
        bitmask = torch.cat([self._states[request_ids[i]].next_row for i in rows])
        return GrammarMask(rows, bitmask)

    def feasible_bans(self, request_id: str, banned: tuple[int, ...]) -> tuple[int, ...]:
        """`banned` (min_tokens' EOS and stop ids), or () if it would ban every token the
        grammar allows: the grammar takes precedence."""
        state = self._states.get(request_id)
        if state is None or not banned:
            return banned
        rest = state.next_row[0] & ~token_words(banned, self.vocab_size)
        return banned if bool(rest.any()) else ()

    def advance(self, request_id: str, token_id: int) -> bool:
        """Accept the sampled token and compute the next row; False if the grammar rejects it."""
        state = self._states[request_id]
        if not state.matcher.accept_token(token_id):
            return False
        if state.matcher.is_terminated:
            state.next_row.zero_()
        else:
            state.matcher.fill_bitmask(state.next_row, 0)
        return True

    def is_complete(self, request_id: str) -> bool:
        """Nothing but EOS may follow (or EOS was accepted)."""
        state = self._states[request_id]
        return state.matcher.is_terminated or not bool((state.next_row[0] & self._not_eos).any())
