"""Grammar-constrained decoding: specs, compilers (outlines-core, xgrammar), matchers."""
from .spec import GrammarError, GrammarSpec

__all__ = ["GrammarError", "GrammarSpec"]
