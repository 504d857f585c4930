"""At most max_loras LoRA adapters among the running requests (core/lora), so every step fits the
adapter slots: a step schedules running requests only, and the runner makes the step's adapters
resident (core/lora/manager.py activate).

A waiting request whose adapter would be one too many waits, and lets pass the requests behind it
that use the base model only: adapter requests keep their order among themselves, so the running
adapters drain and the waiting one gets its turn (nobody starves). Pure Python.
"""
from __future__ import annotations

from collections.abc import Sequence

from .request import Request


class AdapterLimit:
    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras must be positive, got {max_loras}")
        self.max_loras = max_loras

    def next_admissible(self, waiting: Sequence[Request], running: Sequence[Request]) -> int | None:
        """The index in `waiting` of the next request to admit: the first, unless its adapter
        would be one too many; then the first behind it that uses the base model, or None."""
        if not waiting:
            return None
        name = waiting[0].lora_name
        adapters = {r.lora_name for r in running if r.lora_name is not None}
        if name is None or name in adapters or len(adapters) < self.max_loras:
            return 0
        return next((i for i, r in enumerate(waiting) if r.lora_name is None), None)
