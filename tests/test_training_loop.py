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

