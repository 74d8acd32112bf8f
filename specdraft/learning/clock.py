"""The clock type every timing in specdraft reads, and the host's clock. Plain Python: the
driver and the planner time rounds with it without importing torch; `core/stopwatch.py`
adds the device-aware clock on top."""

from __future__ import annotations

import time
from typing import Callable

Clock = Callable[[], float]


def host_clock() -> float:
    """time.perf_counter, looked up at each call (tests replace it with a fake clock)."""
    return time.perf_counter()
