"""The CPU backend's eager runner: core's ModelRunner, with decode rows multiplied as decodes.

A step whose requests are all attended as decode rows (core/runner.py `decodes_by_row`: decodes,
and decodes verifying speculative proposals) runs its Python modules within `quant.decode_step`,
so block-format weights keep the integer kernel up to DECODE_BATCH_ROWS rows, as the fused C++
decode layers do, instead of switching to the dequantized GEMM past 16 rows. A decode row's
logits then do not depend on how many rows share its step (the decode attention kernel does not
either), and greedy speculation gives exactly the tokens of greedy decoding.
"""
from __future__ import annotations

from switchyard.core.decode_batch import decode_rows_only
from switchyard.core.runner import ModelRunner

from .quant import BlockLinear, decode_step


class CpuModelRunner(ModelRunner):
    def __init__(self, model, backend, kv_caches, block_size: int):
        super().__init__(model, backend, kv_caches, block_size)
        self.block_linears = [m for m in model.modules() if isinstance(m, BlockLinear)]

    def execute(self, scheduler_output):
        if not decode_rows_only(scheduler_output) or not self.block_linears:
            return super().execute(scheduler_output)
        with decode_step(self.block_linears):
            return super().execute(scheduler_output)
