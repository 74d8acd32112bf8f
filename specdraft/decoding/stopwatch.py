"""A per-round stopwatch: laps charged to named phases (draft, verify, evaluate, overhead)."""

from __future__ import annotations

import time
from collections import defaultdict


class Stopwatch:
    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.spent: defaultdict[str, float] = defaultdict(float)

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to `phase`."""
        now = time.perf_counter()
        self.spent[phase] += now - self.last
        self.last = now

    def move(self, seconds: float, source: str, target: str) -> None:
        """Re-charge `seconds` of `source` to `target` (time measured inside a lap)."""
        self.spent[source] -= seconds
        self.spent[target] += seconds

    @property
    def elapsed(self) -> float:
        """Seconds from the start to the last lap."""
        return self.last - self.started

    def __getitem__(self, phase: str) -> float:
        return self.spent.get(phase, 0.0)
