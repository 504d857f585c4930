"""The one per-model object through which a step's adapters reach the wrapped layers.

The runner sets `batch` before the model's forward (every token of the step) and again before
each compute_logits (the rows whose logits are computed), and clears it afterwards; every
wrapper (layers.py) reads it. vLLM's punica wrapper plays this part: no global state, and a
step with no adapter token (batch None) adds nothing to any layer.
"""
from __future__ import annotations

from contextlib import contextmanager

from ..backend_contract import LoraBatch, LoraKernel


class LoraContext:
    def __init__(self, kernel: LoraKernel):
        self.kernel = kernel
        self.batch: LoraBatch | None = None

    @contextmanager
    def rows(self, batch: LoraBatch | None):
        """`batch` for the layers while the block runs; none afterwards."""
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None
