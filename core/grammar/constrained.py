"""The engine's constrained requests: one matcher each, and the bitmask rows of what they sample.

A request's next-token row is filled right after its last token is accepted (once per
token), which also tells at once whether the grammar is complete, i.e. nothing but EOS
may follow: the request then finishes without spending a step on EOS.

Speculative decoding (core/spec): before a request's proposed tokens are verified,
`check_proposals` advances its matcher through them, keeping them up to the first one the
grammar rejects (or through the one that completes it), fills the row of each of the k + 1
verified positions and rolls the matcher back. `mask` gives one row per sampled row (per
VerifyPlan row); after sampling, `accept_run` advances the matcher by every token the request
keeps and cuts the run after the token that completes the grammar, so the finish is decided
as without speculation.

A request whose grammar has a gate (a reasoning model: the grammar applies after its thinking)
gets a `GatedMatcher` (gated.py): its rows allow every token until the gate opens.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .base import CompiledGrammar, GrammarMatcher, allocate_bitmask, mask_bias, token_words
from .gate import GrammarGate
from .gated import GatedMatcher


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
    __slots__ = ("matcher", "proposals", "rows")

    def __init__(self, matcher: GrammarMatcher, rows: torch.Tensor):
        self.matcher = matcher
        self.proposals: tuple[int, ...] = ()  # the checked proposals after the request's last token
        # [1 + len(proposals), words]: the tokens allowed at the next position and after each proposal
        self.rows = rows


class ConstrainedRequests:
    """`max_rollback_tokens`: the most proposals one request verifies in a step (0: no speculation)."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], max_rollback_tokens: int = 0):
        self.vocab_size = vocab_size
        self.max_rollback_tokens = max_rollback_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self._eos_row = token_words(eos_token_ids, vocab_size)
        self._not_eos = ~self._eos_row
        self._states: dict[str, _Constrained] = {}

    def __bool__(self) -> bool:
        return bool(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, request_id: str, compiled: CompiledGrammar, gate: GrammarGate | None = None) -> None:
        """`gate`: the grammar applies only from where it opens (a reasoning model's answer, gated.py)."""
        matcher = compiled.new_matcher(self.max_rollback_tokens)
        if gate is not None:
            matcher = GatedMatcher(matcher, gate, self.eos_token_ids, self.max_rollback_tokens)
        state = _Constrained(matcher, allocate_bitmask(1, self.vocab_size))
        state.matcher.fill_bitmask(state.rows, 0)
        self._states[request_id] = state

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def mask(self, request_ids: Sequence[str], drafts: Mapping[str, Sequence[int]] | None = None
             ) -> GrammarMask | None:
        """The mask of this step's constrained rows; None (and no work) if there are none.
        `request_ids` names the request of each sampled row: a request that verifies the
        proposals `drafts[request_id]` has len(drafts) + 1 consecutive rows, any other one."""
        if not self._states:
            return None
        rows = tuple(i for i, rid in enumerate(request_ids) if rid in self._states)
        if not rows:
            return None
        drafts = drafts or {}
        parts = [self._verify_rows(rid, tuple(drafts.get(rid, ())))
                 for rid in dict.fromkeys(request_ids[i] for i in rows)]
        bitmask = parts[0] if len(parts) == 1 else torch.cat(parts)
        if bitmask.shape[0] != len(rows):
            raise ValueError(f"{len(rows)} constrained rows, but proposals for {bitmask.shape[0]}")
        return GrammarMask(rows, bitmask)

    def check_proposals(self, request_id: str, proposals: Sequence[int]) -> list[int]:
        """The proposals the request may verify: up to the first one its grammar rejects, or
        through the one after which nothing but EOS may follow (the request ends there). Fills
        the row of each verified position (what `mask` and `feasible_bans` read) and rolls the
        matcher back. An unconstrained request keeps them all."""
        state = self._states.get(request_id)
        if state is None:
            return list(proposals)
        matcher, kept = state.matcher, []
        rows = allocate_bitmask(min(len(proposals), self.max_rollback_tokens) + 1, self.vocab_size)
        rows[0] = state.rows[0]
        for token_id in proposals[:rows.shape[0] - 1]:
            row = rows[len(kept)]
            if self._row_complete(row) or not self._allows(row, token_id) or not matcher.accept_token(token_id):
                break
            kept.append(token_id)
            self._fill(matcher, rows, len(kept))
        matcher.rollback(len(kept))
        state.proposals, state.rows = tuple(kept), rows[:len(kept) + 1]
        return kept

    def feasible_bans(self, request_id: str, banned: tuple[int, ...], position: int = 0) -> tuple[int, ...]:
        """`banned` (min_tokens' EOS and stop ids), or () if it would ban every token the
        grammar allows at the request's next position (or `position` proposals after it):
        the grammar takes precedence."""
        state = self._states.get(request_id)
        if state is None or not banned:
            return banned
        row = state.rows[min(position, state.rows.shape[0] - 1)]
        rest = row & ~token_words(banned, self.vocab_size)
        return banned if bool(rest.any()) else ()

    def advance(self, request_id: str, token_id: int) -> bool:
        """Accept the sampled token and compute the next row; False if the grammar rejects it."""
        return self.accept_run(request_id, [token_id]) is not None

    def accept_run(self, request_id: str, token_ids: Sequence[int]) -> int | None:
        """Advance through the tokens the request keeps this step, in order: how many of them
        it keeps, up to and including the first after which the grammar is complete (nothing
        may follow it, as without speculation); None if the grammar rejects one of them. The
        next row is computed (the rows of checked proposals are reused)."""
        state = self._states[request_id]
        matcher, checked = state.matcher, state.proposals
        rows = allocate_bitmask(1, self.vocab_size)
        count, on_checked = 0, True  # on_checked: the tokens so far are checked proposals
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                state.proposals, state.rows = (), rows
                return None
            on_checked = on_checked and count < len(checked) and token_id == checked[count]
            count += 1
            if on_checked:
                rows[0] = state.rows[count]
            else:
                self._fill(matcher, rows, 0)
            if matcher.is_terminated or self._row_complete(rows[0]):
                break
        if matcher.is_terminated:
            rows.zero_()
        state.proposals, state.rows = (), rows
        return count

    def is_complete(self, request_id: str) -> bool:
        """Nothing but EOS may follow (or EOS was accepted)."""
        state = self._states[request_id]
        return state.matcher.is_terminated or self._row_complete(state.rows[0])

    def _verify_rows(self, request_id: str, drafts: tuple[int, ...]) -> torch.Tensor:
        """The rows of a request that verifies `drafts`: those `check_proposals` filled, or
        filled now (a draft the grammar rejects cannot be accepted: its position repeats the
        last row, whose sample is never kept)."""
        state = self._states[request_id]
        if drafts != state.proposals[:len(drafts)]:
            self.check_proposals(request_id, drafts)
        rows = state.rows[:len(drafts) + 1]
        if rows.shape[0] < len(drafts) + 1:
            rows = torch.cat([rows, rows[-1:].expand(len(drafts) + 1 - rows.shape[0], -1)])
        return rows

    def _fill(self, matcher: GrammarMatcher, rows: torch.Tensor, index: int) -> None:
        """Row `index`: what may follow the tokens accepted so far. After an EOS nothing may,
        but the position is still sampled (never kept): it gets the EOS row, not an empty one."""
        if matcher.is_terminated:
            rows[index] = self._eos_row
        else:
            matcher.fill_bitmask(rows, index)

    def _row_complete(self, row: torch.Tensor) -> bool:
        return not bool((row & self._not_eos).any())

    def _allows(self, row: torch.Tensor, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size and bool((int(row[token_id >> 5]) >> (token_id & 31)) & 1)
