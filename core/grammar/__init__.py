"""Grammar-constrained decoding: specs, compilers (outlines-core, xgrammar), matchers.

The gateway imports this package for `GrammarSpec`, `GrammarError` and `GrammarUnavailable`
(spec.py) and must not load torch: the engine-side names (matchers, masks, the compile
service, which need torch) are imported on first use through PEP 562's module `__getattr__`,
from the fixed table `_ENGINE_SIDE` below (a declared list, not discovery)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..config import GrammarConfig
from .spec import GrammarError, GrammarSpec, GrammarUnavailable

if TYPE_CHECKING:
    from .base import CompiledGrammar, GrammarCompiler, GrammarMatcher
    from .constrained import ConstrainedRequests, GrammarMask, apply_grammar_mask
    from .service import GrammarCompileService

GRAMMAR_BACKENDS = ("xgrammar", "outlines")

# name -> submodule: the engine side, loaded when first asked for (they import torch)
_ENGINE_SIDE = {
    "CompiledGrammar": ".base", "GrammarCompiler": ".base", "GrammarMatcher": ".base",
    "ConstrainedRequests": ".constrained", "GrammarMask": ".constrained", "apply_grammar_mask": ".constrained",
    "GrammarCompileService": ".service",
}


def __getattr__(name: str):
    if name not in _ENGINE_SIDE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_ENGINE_SIDE[name], __name__), name)
    globals()[name] = value
    return value


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
           "GrammarCompiler", "GrammarError", "GrammarMask", "GrammarMatcher", "GrammarSpec", "GrammarUnavailable",
           "apply_grammar_mask", "make_compiler"]
