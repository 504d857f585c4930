"""Grammar-constrained decoding: specs, compilers (outlines-core, xgrammar), matchers."""
from __future__ import annotations

from ..config import GrammarConfig
from .base import CompiledGrammar, GrammarCompiler, GrammarMatcher
from .constrained import ConstrainedRequests, GrammarMask, apply_grammar_mask
from .service import GrammarCompileService
from .spec import GrammarError, GrammarSpec

GRAMMAR_BACKENDS = ("xgrammar", "outlines")


def make_compiler(config: GrammarConfig, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]
                  ) -> GrammarCompiler:
    """The compiler `config.backend` names, for one tokenizer and logits width."""
    if config.backend == "xgrammar":
        from .xgrammar_backend import XGrammarCompiler

        return XGrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    if config.backend == "outlines":
        from .outlines_backend import OutlinesCompiler

        return OutlinesCompiler(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"unknown grammar backend {config.backend!r}; expected one of {GRAMMAR_BACKENDS}")


__all__ = ["GRAMMAR_BACKENDS", "CompiledGrammar", "ConstrainedRequests", "GrammarCompileService",
           "GrammarCompiler", "GrammarError", "GrammarMask", "GrammarMatcher", "GrammarSpec",
           "apply_grammar_mask", "make_compiler"]
