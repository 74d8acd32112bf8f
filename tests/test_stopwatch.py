"""The round's stopwatch charges each lap to its phase and can move time between phases;
on a GPU every clock reading first waits for the device's queued work."""

from __future__ import annotations

import torch

from specdraft.core import stopwatch
from specdraft.core.stopwatch import Stopwatch, device_clock, host_clock
from specdraft.models.cached_lm import CachedLM
from tiny import tiny_llama


def test_laps_are_charged_to_their_phase():
    clock = iter([10.0, 10.5, 12.0, 12.25, 13.0])
    watch = Stopwatch(lambda: next(clock))  # 10.0
    watch.lap("draft")  # 0.5
    watch.lap("verify")  # 1.5
    watch.lap("overhead")  # 0.25
    watch.lap("overhead")  # 0.75
    watch.move(0.5, "overhead", "evaluate")
    assert (watch["draft"], watch["verify"], watch["overhead"], watch["evaluate"]) == (0.5, 1.5, 0.5, 0.5)
    assert watch["never"] == 0.0
    assert watch.elapsed == 3.0


def test_a_cuda_clock_waits_for_the_device_before_reading(monkeypatch):
    """Kernels run after the host moves on: a reading taken without waiting would time the
    launch, not the work. (Runs on any machine: the wait is what is checked.)"""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    monkeypatch.setattr(stopwatch.time, "perf_counter", lambda: events.append(("read", None)) or 1.0)
    clock = device_clock(torch.device("cuda:0"))
    watch = Stopwatch(clock)
    watch.lap("verify")
    assert events == [("sync", "cuda:0"), ("read", None)] * 2


def test_cpu_timings_read_the_plain_clock():
    assert device_clock(torch.device("cpu")) is host_clock
    assert CachedLM(tiny_llama()).clock is host_clock
