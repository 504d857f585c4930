"""A request's matcher behind a `GrammarGate` (gate.py): free until the gate opens, then the
compiled grammar's matcher, which sees only the tokens after the gate.

While free every token is allowed (an EOS ends the output there, as without a grammar),
until a thinking budget is spent: then only the end marker's next token;
at the start of an output with an optional opener, the grammar's first tokens and the
opener's first token are allowed, and once the opener has begun only its next token.
Rollback (speculative decoding) restores the gate's state and rolls the grammar's matcher
back by the tokens it had seen."""
from __future__ import annotations

from collections import deque

import torch

from .base import GrammarMatcher
from .gate import GateState, GrammarGate


class GatedMatcher(GrammarMatcher):
    def __init__(self, inner: GrammarMatcher, gate: GrammarGate, eos_token_ids: tuple[int, ...],
                 max_rollback_tokens: int = 0):
        self._inner = inner
        self._gate = gate
        self._eos = frozenset(eos_token_ids)
        self._state = gate.start()
        self._terminated = False  # an EOS accepted while free
        # per accepted token, newest last: (gate state before it, terminated before it, the grammar saw it)
        self._history: deque[tuple[GateState, bool, bool]] = deque(maxlen=max_rollback_tokens)

    @property
    def _constrained(self) -> bool:
        return self._state.phase == "constrained"

    def accept_token(self, token_id: int) -> bool:
        before = (self._state, self._terminated)
        if self._terminated and not self._constrained:
            return False
        if self._state.phase == "opening" and self._state.matched \
                and token_id != self._gate.opener[self._state.matched]:
            return False  # an opener, once begun, is finished
        forced = self._gate.forced(self._state)
        if forced is not None and token_id != forced:
            return False  # the thinking budget is spent: the end marker, token by token
        state, free = self._gate.step(self._state, token_id)
        if not free and not self._inner.accept_token(token_id):
            return False
        self._state = state
        if free and token_id in self._eos:
            self._terminated = True
        self._history.append((*before, not free))
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        state = self._state
        if state.phase == "constrained":
            self._inner.fill_bitmask(bitmask, row)
        elif state.phase == "free":
            forced = self._gate.forced(state)
            if forced is None:
                bitmask[row] = -1  # every bit: every token
            else:
                bitmask[row] = 0
                _allow(bitmask, row, forced)
        elif state.matched == 0:
            self._inner.fill_bitmask(bitmask, row)
            _allow(bitmask, row, self._gate.opener[0])
        else:
            bitmask[row] = 0
            _allow(bitmask, row, self._gate.opener[state.matched])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._history)} are kept")
        seen = 0
        for _ in range(num_tokens):
            self._state, self._terminated, fed = self._history.pop()
            seen += fed
        if seen:
            self._inner.rollback(seen)

    @property
    def can_terminate(self) -> bool:
        return self._inner.can_terminate if self._constrained else True

    @property
    def is_terminated(self) -> bool:
        return self._inner.is_terminated if self._constrained else self._terminated


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    word, bit = token_id >> 5, token_id & 31
    if word >= bitmask.shape[1]:
        return
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
