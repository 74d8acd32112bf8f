"""The training loop every trained kind shares (training/loop.py): Ctrl-C saves and the next
run resumes, and a diverging run stops keeping the last good checkpoint."""

from __future__ import annotations

import pytest
import torch

from specdraft.training.loop import STATE, LoopSettings, train


def test_ctrl_c_saves_a_usable_head_and_the_next_run_resumes(tmp_path):
    from rich.console import Console

    head = torch.nn.Linear(2, 1)
    saved = []

    def step_loss(step):
        if step == 3 and not saved:
            raise KeyboardInterrupt
        return (head(torch.ones(1, 2)) ** 2).sum(), {"loss": 0.0}

    settings = LoopSettings(steps=6, lr=1e-2, warmup=1, identity={"data": "x"})
    console = Console(stderr=True, quiet=True)
    with pytest.raises(KeyboardInterrupt):
        train(head, settings, step_loss, lambda step, m: saved.append(step), tmp_path, console)
    assert saved == [3] and (tmp_path / STATE).exists()
    weights = head.weight.detach().clone()
    result = train(head, settings, step_loss, lambda step, m: saved.append(step), tmp_path, console)
    assert result.resumed_from == 3 and result.step == 6 and saved[-1] == 6
    assert not torch.equal(weights, head.weight)
    other = LoopSettings(steps=6, lr=1e-2, warmup=1, identity={"data": "y"})  # other data: from scratch
    assert train(head, other, step_loss, lambda *a: None, tmp_path, console).resumed_from == 0


def test_a_diverging_run_stops_with_exit_1_and_keeps_the_last_good_checkpoint(tmp_path):
    from rich.console import Console

    from specdraft.training.loop import TrainingDiverged

    console = Console(stderr=True, quiet=True)
    head = torch.nn.Linear(2, 1)
    saved = []

    def save(step, metrics):
        assert all(torch.isfinite(p).all() for p in head.parameters())
        saved.append(step)

    def nan_at_step_4(step):
        loss = (head(torch.ones(1, 2)) ** 2).sum()
        return (loss * float("nan") if step == 4 else loss), {}

    settings = LoopSettings(steps=8, lr=1e-2, warmup=1, checkpoint_seconds=0.0, identity={"data": "x"})
    with pytest.raises(TrainingDiverged, match="the loss became nan at step 5 .*keeps the checkpoint of step 4") as err:
        train(head, settings, nan_at_step_4, save, tmp_path, console)
    assert err.value.exit_code == 1 and saved == [1, 2, 3, 4]
    assert torch.load(tmp_path / STATE, weights_only=False)["step"] == 4

    # --lr inf: the first update makes the weights nan; the final save is refused
    other = torch.nn.Linear(2, 1)
    saved.clear()
    inf_lr = LoopSettings(steps=1, lr=float("inf"), warmup=1, identity={"data": "y"})
    with pytest.raises(TrainingDiverged, match="nothing was saved"):
        train(other, inf_lr, lambda step: ((other(torch.ones(1, 2)) ** 2).sum(), {}), save, tmp_path / "o", console)
    assert saved == [] and not (tmp_path / "o" / STATE).exists()



class FakeClock:
    """time.perf_counter for the loop: each step takes the seconds its loss says."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now


def test_a_time_budget_runs_the_steps_that_fit_and_a_resumed_run_keeps_that_count(tmp_path, monkeypatch):
    from rich.console import Console

    import specdraft.training.loop as loop

    clock = FakeClock()
    monkeypatch.setattr(loop, "time", clock)
    for folder in ("roomy", "early"):
        (tmp_path / folder).mkdir()
    console = Console(stderr=True, quiet=True)
    head = torch.nn.Linear(2, 1)
    stop = [9]

    def step_loss(step):  # the first step allocates (5 s), the others take 1 s; a Ctrl-C at step `stop`
        if step == stop[0]:
            stop[0] = None
            raise KeyboardInterrupt
        clock.now += 5.0 if step == 0 else 1.0
        return (head(torch.ones(1, 2)) ** 2).sum(), {}

    # timed after 5 steps past the first (10 s gone, 1 s a step): 6 + 10 more fit in 20.5 s
    settings = LoopSettings(steps=100, lr=1e-2, warmup=20, identity={"data": "x"}, seconds=20.5)
    with pytest.raises(KeyboardInterrupt):
        train(head, settings, step_loss, lambda *a: None, tmp_path, console)
    state = torch.load(tmp_path / STATE, weights_only=False)
    assert (state["step"], state["steps"], state["planned"]) == (9, 16, True)
    # resumed, at another speed: it finishes the count the first run fixed
    again = LoopSettings(steps=100, lr=1e-2, warmup=20, identity={"data": "x"}, seconds=20.5)
    result = train(head, again, step_loss, lambda *a: None, tmp_path, console)
    assert result.resumed_from == 9 and result.step == 16 and again.steps == 16

    # a budget larger than the planned steps needs: the planned steps
    roomy = LoopSettings(steps=12, lr=1e-2, warmup=2, identity={"data": "y"}, seconds=1e6)
    assert train(head, roomy, step_loss, lambda *a: None, tmp_path / "roomy", console).step == 12
    # stopped before it was timed: the next run times its own steps
    clock.now, stop[0] = 1000.0, 3
    early = LoopSettings(steps=100, lr=1e-2, warmup=20, identity={"data": "z"}, seconds=30.5)
    with pytest.raises(KeyboardInterrupt):
        train(head, early, step_loss, lambda *a: None, tmp_path / "early", console)
    assert torch.load(tmp_path / "early" / STATE, weights_only=False)["planned"] is False
    resumed = LoopSettings(steps=100, lr=1e-2, warmup=20, identity={"data": "z"}, seconds=30.5)
    # steps 4..8 timed after this run's first (1 s each; 6 s gone at step 9): 9 + 24 more fit in 30.5 s
    assert train(head, resumed, step_loss, lambda *a: None, tmp_path / "early", console).step == 33


def test_steps_that_slow_down_after_timing_are_cut_to_the_budget_at_checkpoints(tmp_path, monkeypatch):
    from rich.console import Console

    import specdraft.training.loop as loop

    clock = FakeClock()
    monkeypatch.setattr(loop, "time", clock)
    head = torch.nn.Linear(2, 1)

    def step_loss(step):  # 5 s, then 1 s a step while timed, then 3 s a step
        clock.now += 5.0 if step == 0 else 1.0 if step < 6 else 3.0
        return (head(torch.ones(1, 2)) ** 2).sum(), {}

    settings = LoopSettings(steps=100, lr=1e-2, warmup=20, identity={"data": "x"}, seconds=40.5, checkpoint_seconds=5.0)
    result = train(head, settings, step_loss, lambda *a: None, tmp_path, Console(stderr=True, quiet=True))
    # timed at 1 s a step, 36 steps seemed to fit; at 3 s a step the checkpoints cut the count
    assert result.step < 36 and result.step == settings.steps
    assert abs((clock.now - 1000.0) - 40.5) <= 6.0  # within a checkpoint's interval of the budget
