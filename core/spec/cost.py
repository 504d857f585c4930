"""What one more query row costs a decode step, learned from the engine's own steps.

A decode step's time is close to a line in its rows: t = fixed + per_row * rows. The fixed part
is reading the weights and the step's overheads; the per-row part is each row's arithmetic and
its attention. Measured on a 2-core AMX Xeon with the default model (bf16, 700-token contexts):
8.5 ms at one row, +1.2 ms a row, so a proposed token is far from free on a CPU; on a GPU at
small batches a row costs almost nothing. `StepCost` fits the line online, by exponentially
weighted least squares over the decode-only steps the engine reports (rows, and the seconds of
the whole step: scheduling and proposing, the forward, sampling every row and settling the
verified runs, so that what a proposal costs outside the model counts too), and gives
`row_cost` = per_row / fixed, which the speculator weighs proposals against. Until the steps
seen vary enough in rows to fit (speculation itself varies them) it answers `prior`: the
backend's declared Capabilities.decode_row_cost.
"""
from __future__ import annotations

from ..backend_contract import Capabilities

DEFAULT_ROW_COST = Capabilities.decode_row_cost  # before any fit: a backend that declares none
# Weight kept by the older steps at each new one: the line is the machine's and the model's, and
# changes slowly, while the rows of a steady load barely vary, so the fit remembers ~1000 steps
# (the ramps up and down of earlier loads among them).
_DECAY = 0.999
_MIN_ROW_VARIANCE = 1.0  # rows the fit needs to have seen varying (weighted variance) before it is used


class StepCost:
    def __init__(self, prior: float = DEFAULT_ROW_COST):
        self.prior = prior
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """One decode-only step of `rows` query rows that took `seconds` (the engine's whole step)."""
        d = _DECAY
        self._w, self._x, self._y = d * self._w + 1, d * self._x + rows, d * self._y + seconds
        self._xx, self._xy = d * self._xx + rows * rows, d * self._xy + rows * seconds

    @property
    def row_cost(self) -> float:
        """One more row's time over the step's fixed time (clamped to [0.002, 2])."""
        w = self._w
        if w < 8:
            return self.prior
        variance = self._xx / w - (self._x / w) ** 2
        if variance < _MIN_ROW_VARIANCE:
            return self.prior
        per_row = (self._xy / w - (self._x / w) * (self._y / w)) / variance
        fixed = self._y / w - per_row * self._x / w
        if fixed <= 0:
            return 2.0
        return min(2.0, max(0.002, per_row / fixed))
