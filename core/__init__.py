"""Switchyard's backend-neutral engine core."""
from .params import SamplingParams, ValidationError


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name in ("LLM", "GenerationResult", "CompletionOutput"):
        from . import llm
        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "ValidationError", "GenerationResult", "CompletionOutput"]
