"""outlines-core: a regex (JSON schemas become one) compiled into a token-level DFA index.

outlines-core (0.2.10 to 0.2.14 at least) drops every token that leaves an accepting
state for a non-accepting one when the token ends one byte past the accepting point: its
automaton reports matches one byte late, and the index builder reads that as "already
matched". So `[0-9]+(\\.[0-9]+)?` refuses "." after "3" (3.14 comes out as 314) and
`[a-z]+(-[a-z]+)*` refuses "-" after "well". The workaround: the index is built for
`(regex)` followed by a sentinel character that no other token can write (U+10FFFF,
a noncharacter; tokens with its lead byte 0xF4 are left out), spelled by one spare token
id. Then no proper prefix is ever accepting and nothing is dropped; "the regex accepts
here" is "the sentinel token leads to a final state" (the sentinel may also be a string
character for the regex: that leads on to a non-final state). The sentinel never reaches
a mask: where the regex accepts, the EOS tokens are allowed instead.
"""
from __future__ import annotations

import json
import pickle
from collections import deque

import torch

from .base import CompiledGrammar, GrammarCompiler, GrammarMatcher, grammar_error, token_words
from .schema_support import OUTLINES_UNSUPPORTED, check_schema_support, strict_formats
from .spec import GrammarSpec
from .structural import check_structure, regex_of
from .vocabulary import token_byte_map

# Compact JSON: no free whitespace (small models otherwise loop on it until max_tokens).
_WHITESPACE = ""
_MAX_CACHED_STATES = 4096  # masks of 6 KiB each for a 49k vocabulary: at most 24 MiB per grammar
SENTINEL = "\U0010ffff"
_SENTINEL_LEAD = SENTINEL.encode()[0]


class OutlinesMatcher(GrammarMatcher):
    """The automaton's state lives in an outlines Guide, which keeps its last
    `max_rollback_tokens` states; an accepted EOS only sets `_terminated`. `_steps` records,
    for each token still undoable, whether it moved the guide (False: it was the EOS), so a
    rollback winds the guide back by the tokens that moved it and clears the EOS."""

    def __init__(self, compiled: OutlinesCompiled, max_rollback_tokens: int = 0):
        import outlines_core

        if max_rollback_tokens < 0:
            raise ValueError(f"max_rollback_tokens must be >= 0, got {max_rollback_tokens}")
        self._compiled = compiled
        self._guide = outlines_core.Guide(compiled.index, max_rollback=max_rollback_tokens)
        self._terminated = False
        self._steps: deque[bool] = deque(maxlen=max_rollback_tokens)

    def accept_token(self, token_id: int) -> bool:
        if self._terminated or token_id == self._compiled.sentinel_id:
            return False
        if token_id in self._compiled.eos_token_ids:
            if not self.can_terminate:
                return False
            self._terminated = True
            self._record(False)
            return True
        if not self._guide.accepts_tokens([token_id]):
            return False
        self._guide.advance(token_id, return_tokens=False)
        self._record(True)
        return True

    def _record(self, moved_guide: bool) -> None:
        if self._steps.maxlen:
            self._steps.append(moved_guide)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._steps):
            raise ValueError(f"cannot roll back {num_tokens} tokens: the matcher keeps its last {len(self._steps)}")
        undone = [self._steps.pop() for _ in range(num_tokens)]
        if undone and not undone[0]:  # only the last token can be the EOS: nothing follows it
            self._terminated = False
        moves = sum(undone)
        if moves:
            self._guide.rollback_state(moves)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            bitmask[row].zero_()
        else:
            bitmask[row].copy_(self._compiled.state_mask(self._guide))

    @property
    def can_terminate(self) -> bool:
        return not self._terminated and self._compiled.accepts_at(self._guide.get_state())

    @property
    def is_terminated(self) -> bool:
        return self._terminated


class OutlinesCompiled(CompiledGrammar):
    """Masks are cached per automaton state: outlines writes a mask by walking every
    allowed token (milliseconds for a state inside a JSON string), and generation
    revisits the same few states over and over."""

    def __init__(self, index, compiler: OutlinesCompiler):
        self.index = index
        self.eos_token_ids = frozenset(compiler.eos_token_ids)
        self.sentinel_id = compiler.sentinel_id
        self._eos_words = compiler.eos_words
        self._sentinel_words = compiler.sentinel_words
        self._final_states = frozenset(index.get_final_states())
        self._state_masks: dict[int, torch.Tensor] = {}  # bounded by _MAX_CACHED_STATES

    def new_matcher(self, max_rollback_tokens: int = 0) -> OutlinesMatcher:
        return OutlinesMatcher(self, max_rollback_tokens)

    def accepts_at(self, state: int) -> bool:
        """Whether the regex accepts the output that led to `state`."""
        return self.index.get_next_state(state, self.sentinel_id) in self._final_states

    def state_mask(self, guide) -> torch.Tensor:
        state = guide.get_state()
        mask = self._state_masks.get(state)
        if mask is None:
            mask = torch.zeros_like(self._eos_words)
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            mask &= ~(self._sentinel_words | self._eos_words)
            if self.accepts_at(state):  # every EOS id, not only the one outlines knows
                mask |= self._eos_words
            if len(self._state_masks) < _MAX_CACHED_STATES:  # dict writes are atomic under the GIL
                self._state_masks[state] = mask
        return mask


class OutlinesCompiler(GrammarCompiler):
    """Portable: it pickles (the vocabulary included), and so does a compiled index."""

    name = "outlines"
    portable = True

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import outlines_core

        if not eos_token_ids:
            raise ValueError("the outlines grammar backend needs an end-of-sequence token id")
        tokens = {data: ids for data, ids in token_byte_map(tokenizer, vocab_size).items()
                  if _SENTINEL_LEAD not in data}
        used = {i for ids in tokens.values() for i in ids} | set(eos_token_ids)
        self.sentinel_id = next((i for i in range(vocab_size) if i not in used), None)
        if self.sentinel_id is None:
            raise ValueError("the outlines grammar backend needs one token id outside the text vocabulary")
        tokens[SENTINEL.encode()] = [self.sentinel_id]
        self._vocabulary = outlines_core.Vocabulary(eos_token_ids[0], tokens)
        self.eos_token_ids = eos_token_ids
        self.eos_words = token_words(eos_token_ids, vocab_size)
        self.sentinel_words = token_words([self.sentinel_id], vocab_size)

    def compile(self, spec: GrammarSpec) -> OutlinesCompiled:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        check_schema_support(spec, OUTLINES_UNSUPPORTED, self.name)
        try:
            if spec.kind == "regex":
                regex = strip_anchors(spec.value)
            elif spec.kind == "structural":
                check_structure(spec.structure)
                regex = regex_of(spec.structure, lambda schema: build_regex_from_schema(
                    strict_formats(GrammarSpec.json_schema(schema)), whitespace_pattern=_WHITESPACE), self.name)
            else:
                schema = strict_formats(spec) if spec.kind == "json_schema" else json.dumps({"type": "object"})
                regex = build_regex_from_schema(schema, whitespace_pattern=_WHITESPACE)
            index = outlines_core.Index(f"({regex}){SENTINEL}", self._vocabulary)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise grammar_error(spec, exc) from None
        return OutlinesCompiled(index, self)

    def dump(self, compiled: OutlinesCompiled) -> bytes:
        return pickle.dumps(compiled.index)

    def load(self, data: bytes) -> OutlinesCompiled:
        compiled = OutlinesCompiled(pickle.loads(data), self)  # noqa: S301 - bytes from our own worker
        compiled.nbytes = len(data)
        return compiled


def strip_anchors(pattern: str) -> str:
    """A spec's regex must match the whole output anyway; outlines rejects ^ and $ anchors."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and (len(pattern) - len(pattern[:-1].rstrip("\\")) - 1) % 2 == 0:
        pattern = pattern[:-1]
    return pattern
