"""A per-round stopwatch: laps charged to named phases (draft, verify, evaluate, overhead),
and the device-aware clock every timing in the decode path reads.

On a GPU, kernels run after the host has moved on: a host clock read right after a forward
measures the launch, not the work. `device_clock` waits for the device first, so the round
records, the cost model, the panel and replay traces see what each phase really took. The
wait costs little here: every round already syncs to learn how many tokens were accepted.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from specdraft.learning.clock import Clock, host_clock


def device_clock(device: torch.device) -> Clock:
    """perf_counter, after the device's queued work is done (CUDA, MPS); plain on CPU."""
    if device.type == "cuda":
        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return clock
    if device.type == "mps":
        def mps_clock() -> float:
            torch.mps.synchronize()
            return time.perf_counter()
        return mps_clock
    return host_clock


class Stopwatch:
    def __init__(self, clock: Clock = host_clock) -> None:
        self.clock = clock
        self.started = self.last = clock()
        self.spent: defaultdict[str, float] = defaultdict(float)

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to `phase`."""
        now = self.clock()
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
