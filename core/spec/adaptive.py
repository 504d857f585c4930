"""Adaptive speculation: a request whose proposals keep being rejected stops proposing.

Each verified step updates an exponential average of the request's acceptance rate (accepted /
proposed). Once it has been measured over `min_samples` steps and falls below the configured
floor, the request decodes plainly for a pause that doubles each time (up to `max_pause`
decode steps), then tries again: a request that turns repetitive later still benefits, and a
non-repetitive one costs a verify step only now and then.
"""
from __future__ import annotations

_ALPHA = 0.3  # weight of the newest step in the average
_MIN_SAMPLES = 3
_FIRST_PAUSE = 8
_MAX_PAUSE = 256


class AcceptanceTracker:
    __slots__ = ("floor", "rate", "num_samples", "pause_left", "next_pause")

    def __init__(self, floor: float):
        self.floor = floor
        self.rate = 1.0
        self.num_samples = 0
        self.pause_left = 0
        self.next_pause = _FIRST_PAUSE

    def wants_proposals(self) -> bool:
        """Whether to propose this step (counts a paused step down)."""
        if self.pause_left > 0:
            self.pause_left -= 1
            return False
        return True

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.rate = _ALPHA * (num_accepted / num_proposed) + (1 - _ALPHA) * self.rate
        self.num_samples += 1
        if self.num_samples >= _MIN_SAMPLES and self.rate < self.floor:
            self.pause_left = self.next_pause
            self.next_pause = min(2 * self.next_pause, _MAX_PAUSE)
            self.rate, self.num_samples = 1.0, 0  # measured afresh after the pause
        elif self.rate >= self.floor and self.num_samples >= _MIN_SAMPLES:
            self.next_pause = _FIRST_PAUSE
