"""outlines-core: a regex (JSON schemas become one) compiled into a token-level DFA index."""
from __future__ import annotations

import json

import torch

from .base import CompiledGrammar, GrammarCompiler, GrammarMatcher, grammar_error, token_words
from .schema_support import OUTLINES_UNSUPPORTED, check_schema_support
from .spec import GrammarSpec
from .vocabulary import token_byte_map

# Compact JSON: no free whitespace (small models otherwise loop on it until max_tokens).
_WHITESPACE = ""
_MAX_CACHED_STATES = 4096  # masks of 6 KiB each for a 49k vocabulary: at most 24 MiB per grammar


class OutlinesMatcher(GrammarMatcher):
    def __init__(self, compiled: OutlinesCompiled):
        import outlines_core

        self._compiled = compiled
        self._guide = outlines_core.Guide(compiled.index)
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._compiled.eos_token_ids:
            if not self._guide.is_finished():
                return False
            self._terminated = True
            return True
        if not self._guide.accepts_tokens([token_id]):
            return False
        self._guide.advance(token_id, return_tokens=False)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            bitmask[row].zero_()
        else:
            bitmask[row].copy_(self._compiled.state_mask(self._guide))

    @property
    def can_terminate(self) -> bool:
        return not self._terminated and self._guide.is_finished()

    @property
    def is_terminated(self) -> bool:
        return self._terminated


class OutlinesCompiled(CompiledGrammar):
    """Masks are cached per automaton state: outlines writes a mask by walking every
    allowed token (milliseconds for a state inside a JSON string), and generation
    revisits the same few states over and over."""

    def __init__(self, index, eos_token_ids: tuple[int, ...], eos_words: torch.Tensor):
        self.index = index
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_words = eos_words
        self._state_masks: dict[int, torch.Tensor] = {}  # bounded by _MAX_CACHED_STATES

    def new_matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)

    def state_mask(self, guide) -> torch.Tensor:
        state = guide.get_state()
        mask = self._state_masks.get(state)
        if mask is None:
            mask = torch.zeros_like(self.eos_words)
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            if guide.is_finished():  # every EOS id, not only the one outlines knows
                mask |= self.eos_words
            else:
                mask &= ~self.eos_words
            if len(self._state_masks) < _MAX_CACHED_STATES:  # dict writes are atomic under the GIL
                self._state_masks[state] = mask
        return mask


class OutlinesCompiler(GrammarCompiler):
    name = "outlines"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import outlines_core

        if not eos_token_ids:
            raise ValueError("the outlines grammar backend needs an end-of-sequence token id")
        self._vocabulary = outlines_core.Vocabulary(eos_token_ids[0], token_byte_map(tokenizer, vocab_size))
        self._eos_token_ids = eos_token_ids
        self._eos_words = token_words(eos_token_ids, vocab_size)

    def compile(self, spec: GrammarSpec) -> OutlinesCompiled:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        check_schema_support(spec, OUTLINES_UNSUPPORTED, self.name)
        try:
            if spec.kind == "regex":
                regex = strip_anchors(spec.value)
            else:
                schema = spec.value if spec.kind == "json_schema" else json.dumps({"type": "object"})
                regex = build_regex_from_schema(schema, whitespace_pattern=_WHITESPACE)
            index = outlines_core.Index(regex, self._vocabulary)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise grammar_error(spec, exc) from None
        return OutlinesCompiled(index, self._eos_token_ids, self._eos_words)


def strip_anchors(pattern: str) -> str:
    """A spec's regex must match the whole output anyway; outlines rejects ^ and $ anchors."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and (len(pattern) - len(pattern[:-1].rstrip("\\")) - 1) % 2 == 0:
        pattern = pattern[:-1]
    return pattern
