"""Where a grammar starts to apply in an output: a `GrammarGate` (torch-free, it rides in a
`GrammarSpec`).

A reasoning model thinks before it answers; a grammar (a JSON schema, a regex, tool calls)
is for the answer only, as vLLM applies it. The gate names the token sequence that ends the
free part (`after`: the end-of-thinking marker as the tokenizer encodes it); the grammar
constrains the tokens that follow it. With `opener` (the start-of-thinking marker), the free
part is optional: an output that opens with `opener` is free until `after`, one that opens
with anything else is constrained from its first token (a model that may answer without
thinking, as Qwen3's template lets it).

With `budget` (a thinking budget: vLLM's `thinking_token_budget`, Anthropic's
`budget_tokens`), the free part is at most that many tokens before the end marker: once they
are spent, the gate forces `after`, token by token (`forced`), and the answer follows.

`step` is the one definition of which tokens are free: the engine's matcher
(gated.py) follows it to mask and advance, and the gateway follows it to count an answer's
reasoning tokens. The markers are matched as token sequences; a model whose marker is one
token (every model the reasoning parsers name) matches it exactly.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from ..errors import ValidationError

Phase = Literal["opening", "free", "constrained"]


@dataclass(frozen=True)
class GateState:
    """Where an output is: `opening` (`matched` opener tokens seen), `free` (`matched`: the
    longest end of the output that begins `after`; `spent`: free tokens so far, the opener's
    included), or `constrained` (the grammar applies)."""

    phase: Phase
    matched: int = 0
    spent: int = 0


CONSTRAINED = GateState("constrained")


@dataclass(frozen=True)
class GrammarGate:
    after: tuple[int, ...]
    opener: tuple[int, ...] = ()
    budget: int | None = None  # free tokens before `after` is forced (None: no limit)

    def __post_init__(self) -> None:
        object.__setattr__(self, "after", tuple(int(t) for t in self.after))
        object.__setattr__(self, "opener", tuple(int(t) for t in self.opener))
        if not self.after:
            raise ValidationError("a grammar gate needs the token sequence after which the grammar applies",
                                  "grammar")
        if self.budget is not None and self.budget < 0:
            raise ValidationError(f"a thinking budget must be at least 0, got {self.budget}", "thinking_token_budget")

    def forced(self, state: GateState) -> int | None:
        """The token the output must take next because the budget is spent (the end marker's
        next token), or None where it is free to choose. The marker's own tokens are not counted
        against the budget."""
        if self.budget is None or state.phase != "free" or state.spent - state.matched < self.budget:
            return None
        return self.after[state.matched]

    def start(self) -> GateState:
        return GateState("opening") if self.opener else GateState("free")

    def step(self, state: GateState, token_id: int) -> tuple[GateState, bool]:
        """The state after `token_id`, and whether that token was free (the grammar does not
        see it). The token that completes `after` is free; the ones after it are not. At the
        output's start with an opener, a token other than the opener's first is the grammar's."""
        if state.phase == "constrained":
            return state, False
        if state.phase == "opening":
            if token_id == self.opener[state.matched]:
                matched = state.matched + 1
                return (GateState("free") if matched == len(self.opener) else GateState("opening", matched)), True
            if state.matched == 0:
                return CONSTRAINED, False
            return GateState("free"), True  # a broken opener (the engine never samples one): thinking all the same
        matched = self._advance(state.matched, token_id)
        return (CONSTRAINED if matched == len(self.after) else GateState("free", matched, state.spent + 1)), True

    def num_free(self, token_ids) -> int:
        """How many of an output's first tokens are free (its reasoning tokens)."""
        state, count = self.start(), 0
        for token_id in token_ids:
            state, free = self.step(state, token_id)
            if not free:
                break
            count += 1
        return count

    def _advance(self, matched: int, token_id: int) -> int:
        """Knuth-Morris-Pratt: the longest end of (output + token) that begins `after`."""
        after, fallback = self.after, _fallback(self.after)
        while matched and after[matched] != token_id:
            matched = fallback[matched - 1]
        return matched + 1 if after[matched] == token_id else 0


@functools.lru_cache(maxsize=64)
def _fallback(pattern: tuple[int, ...]) -> tuple[int, ...]:
    """For each prefix of `pattern`, the length of its longest proper prefix that is also its suffix."""
    table, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return tuple(table)
