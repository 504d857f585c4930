"""The error of a model that no path can run."""
from __future__ import annotations


class UnsupportedModelError(ValueError):
    """An architecture neither the native code nor the transformers fallback can run.
    The message is one line: what the model is and what is supported."""
