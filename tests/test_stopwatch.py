"""The round's stopwatch charges each lap to its phase and can move time between phases."""

from __future__ import annotations

from specdraft.decoding import stopwatch
from specdraft.decoding.stopwatch import Stopwatch


def test_laps_are_charged_to_their_phase(monkeypatch):
    clock = iter([10.0, 10.5, 12.0, 12.25, 13.0])
    monkeypatch.setattr(stopwatch.time, "perf_counter", lambda: next(clock))
    watch = Stopwatch()  # 10.0
    watch.lap("draft")  # 0.5
    watch.lap("verify")  # 1.5
    watch.lap("overhead")  # 0.25
    watch.lap("overhead")  # 0.75
    watch.move(0.5, "overhead", "evaluate")
    assert (watch["draft"], watch["verify"], watch["overhead"], watch["evaluate"]) == (0.5, 1.5, 0.5, 0.5)
    assert watch["never"] == 0.0
    assert watch.elapsed == 3.0
