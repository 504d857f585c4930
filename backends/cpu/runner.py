"""The CPU backend's eager runner: core's ModelRunner, every token a decode row where the model
multiplies block-format weights.

Block-format weights take one integer arithmetic for any number of rows (quant.py BlockLinear),
and the decode attention kernel computes a row whatever rows share its call
(csrc/paged_decode.h). Laying every query token out as a decode row (core/execution/runner.py
build_step_input `by_row`), prompt chunks included, then gives a request the same logits
however its prompt was chunked, whether its prefix was cached, and whatever else was batched
with it; greedy speculation gives exactly the tokens of greedy decoding. Float models keep
prompt chunks on SDPA (their oneDNN products depend on the batch's rows anyway).
"""
from __future__ import annotations

from switchyard.core.execution.runner import ModelRunner

from .quant import BlockLinear


class CpuModelRunner(ModelRunner):
    def __init__(self, model, backend, kv_caches, block_size: int):
        super().__init__(model, backend, kv_caches, block_size)
        self.by_row = any(isinstance(m, BlockLinear) for m in model.modules())
