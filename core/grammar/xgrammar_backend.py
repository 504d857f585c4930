"""xgrammar: pushdown automata with a precomputed per-state token mask cache."""
from __future__ import annotations

import json

import torch

from .base import CompiledGrammar, GrammarCompiler, GrammarMatcher, grammar_error
from .schema_support import XGRAMMAR_UNSUPPORTED, check_schema_support, strict_formats
from .spec import GrammarSpec
from .structural import check_structure, xgrammar_structural_tag

# Compact JSON: no free whitespace between tokens. Small models given the freedom
# to emit whitespace tend to loop on it until max_tokens; compact output ends.
_COMPACT = {"any_whitespace": False, "separators": (",", ":")}


class XGrammarMatcher(GrammarMatcher):
    """xgrammar's matcher. Its rollback is unlimited since its Earley parser (its
    `max_rollback_tokens` is deprecated, -1 = unlimited, and a warning for any other value):
    every bound a caller asks for is met."""

    def __init__(self, compiled, max_rollback_tokens: int = 0):
        import xgrammar

        if max_rollback_tokens < 0:
            raise ValueError(f"max_rollback_tokens must be >= 0, got {max_rollback_tokens}")
        self._matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            try:
                self._matcher.rollback(num_tokens)
            except RuntimeError as exc:  # more than it has accepted
                raise ValueError(str(exc)) from None

    @property
    def can_terminate(self) -> bool:
        return self._matcher.is_completed()

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled):
        self._compiled = compiled

    def new_matcher(self, max_rollback_tokens: int = 0) -> XGrammarMatcher:
        return XGrammarMatcher(self._compiled, max_rollback_tokens)


class XGrammarCompiler(GrammarCompiler):
    """Portable: the tokenizer info crosses to a worker as xgrammar's JSON, and a compiled
    grammar comes back as its JSON (deserializing measured 2x faster than even a small
    compile, and far faster than a large one)."""

    name = "xgrammar"
    portable = True

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import xgrammar

        self._setup(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                            stop_token_ids=list(eos_token_ids)))

    def _setup(self, info) -> None:
        import xgrammar

        self._info = info
        # Our own LRU (GrammarCompileService) bounds the cache; xgrammar's would be a second one.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def __getstate__(self) -> dict:
        return {"info": self._info.serialize_json()}

    def __setstate__(self, state: dict) -> None:
        import xgrammar

        self._setup(xgrammar.TokenizerInfo.deserialize_json(state["info"]))

    def dump(self, compiled: XGrammarCompiled) -> bytes:
        return compiled._compiled.serialize_json().encode()

    def load(self, data: bytes) -> XGrammarCompiled:
        import xgrammar

        compiled = XGrammarCompiled(xgrammar.CompiledGrammar.deserialize_json(data.decode(), self._info))
        compiled.nbytes = len(data)
        return compiled

    def compile(self, spec: GrammarSpec) -> XGrammarCompiled:
        check_schema_support(spec, XGRAMMAR_UNSUPPORTED, self.name)
        try:
            if spec.kind == "json_schema":
                compiled = self._compiler.compile_json_schema(strict_formats(spec), **_COMPACT)
            elif spec.kind == "json_object":
                # Any object (not any JSON value), extra properties allowed, still compact.
                compiled = self._compiler.compile_json_schema(json.dumps({"type": "object"}), strict_mode=False,
                                                              **_COMPACT)
            elif spec.kind == "structural":
                check_structure(spec.structure)
                compiled = self._compiler.compile_structural_tag(
                    xgrammar_structural_tag(spec.structure, _compact_json_grammar))
            else:
                compiled = self._compiler.compile_regex(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise grammar_error(spec, exc) from None
        result = XGrammarCompiled(compiled)
        result.nbytes = compiled.memory_size_bytes
        return result


def _compact_json_grammar(schema: dict | bool) -> str:
    """A structural grammar's JSON schema as the EBNF of the compact JSON a json_schema spec
    compiles to (formats made exact, as there)."""
    import xgrammar

    text = strict_formats(GrammarSpec.json_schema(schema))
    return str(xgrammar.Grammar.from_json_schema(text, **_COMPACT))
