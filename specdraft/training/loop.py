"""The training loop every trained drafter kind shares: AdamW with warmup and cosine decay,
gradient clipping, a progress bar with the loss and the time left, a checkpoint every few
minutes that a later run resumes from, and Ctrl-C (or SIGTERM, raised as `Terminated` by
the command) that saves a usable drafter first. A run whose loss, gradient or weights stop
being finite numbers stops with `TrainingDiverged` and saves nothing more: the folder keeps
the last checkpoint written while the weights were finite. With a time budget
(`LoopSettings.seconds`, `--minutes`) the first steps are timed and the run's step count is
fixed from them, and cut at each checkpoint where later steps run slower; the checkpoint keeps
that count, so a resumed run ends where the first would have.

What is trained and how a batch's loss is computed is the caller's (`step_loss`); what a
usable drafter is on disk is the caller's too (`save`). The loop owns the optimizer, the
schedule, the resume state (`training-state.pt` next to the drafter) and the reporting.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specdraft.storage.atomic_files import staged_file
from specdraft.errors import SpecdraftError, Terminated

STATE = "training-state.pt"
TIMED_STEPS = 5  # steps timed (after the first, which allocates) before a time budget fixes the count


class TrainingDiverged(SpecdraftError):
    """The loss, a gradient or the weights became nan or infinite (exit 1, one line)."""


@dataclass
class LoopSettings:
    steps: int
    lr: float = 1e-3
    warmup: int = 20
    clip: float = 1.0
    checkpoint_seconds: float = 120.0
    identity: dict[str, Any] = field(default_factory=dict)  # what must match for a resume
    lr_scale: dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> factor on lr
    seconds: float | None = None  # a time budget: as many steps as fit in it, at most `steps`


@dataclass
class LoopResult:
    step: int
    resumed_from: int
    seconds: float
    last: dict[str, float]


def learning_rate(step: int, settings: LoopSettings) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak at the last step."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    span = max(1, settings.steps - settings.warmup)
    progress = min(1.0, (step - settings.warmup) / span)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(module: torch.nn.Module, settings: LoopSettings, step_loss: Callable[[int], tuple[torch.Tensor, dict]],
          save: Callable[[int, dict[str, float]], None], out: Path, console: Console,
          label: str = "training") -> LoopResult:
    """Run `settings.steps` optimizer steps of `step_loss(step) -> (loss, metrics)` on the
    trainable parameters of `module`, resuming from `out/training-state.pt` when it was
    written by a run with the same identity."""
    _say_state_size(module, out, console)
    loop = _Loop(module, settings, save, out, console, label)
    try:
        loop.run(step_loss)
    except KeyboardInterrupt as stop:
        loop.interrupted(stop)
        raise
    loop.keep()
    return LoopResult(loop.step, loop.resumed_from, time.perf_counter() - loop.started, loop.metrics)


LARGE_STATE = 1 << 30  # bytes: a training state this large is announced before it is first written


def _say_state_size(module: torch.nn.Module, out: Path, console: Console) -> None:
    """The training state (every weight, and AdamW's two moments of each trained one) is kept
    in `out` to resume from; a large one is said before it is written, not found afterwards."""
    weights = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    moments = 2 * sum(p.numel() * 4 for p in module.parameters() if p.requires_grad)
    if weights + moments >= LARGE_STATE:
        console.print(f"the training state kept in {out / STATE} to resume from takes about "
                      f"{(weights + moments) / 2**30:.1f} GiB (the weights and the optimizer's moments); it is "
                      "rewritten at each checkpoint and can be deleted once training is done",
                      markup=False, highlight=False)


def _optimizer(module: torch.nn.Module, settings: LoopSettings) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """The trainable parameters, and AdamW over them in one group per learning-rate scale."""
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for name, parameter in module.named_parameters():
        if parameter.requires_grad:
            scale = next((f for prefix, f in settings.lr_scale.items() if name.startswith(prefix)), 1.0)
            groups.setdefault(scale, []).append(parameter)
    params = [p for group in groups.values() for p in group]
    optimizer = torch.optim.AdamW([{"params": group, "scale": scale} for scale, group in groups.items()],
                                  lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return params, optimizer


class _Loop:
    """One run of `train`: the optimizer, the step reached, the checkpoint kept in `out`."""

    def __init__(self, module: torch.nn.Module, settings: LoopSettings, save: Callable[[int, dict[str, float]], None],
                 out: Path, console: Console, label: str):
        self.module, self.settings, self.save, self.out, self.console, self.label = \
            module, settings, save, out, console, label
        self.params, self.optimizer = _optimizer(module, settings)
        self.state_path = out / STATE
        self.step, self.planned = _resume(self.state_path, module, self.optimizer, settings, console)
        self.resumed_from = self.step
        self.kept = self.step if self.step else None  # the step of the checkpoint in `out` (a resumed run's is there)
        self.started = self.last_checkpoint = time.perf_counter()
        # when this run's first step ended, if this run times its steps (a resumed run whose
        # count was fixed does not: it cannot know the budget's time gone)
        self.first_done: float | None = None
        self.metrics: dict[str, float] = {}

    def run(self, step_loss: Callable[[int], tuple[torch.Tensor, dict]]) -> None:
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), TextColumn("eta"),
                            TimeRemainingColumn(), console=self.console, transient=True,
                            disable=not self.console.is_terminal)
        with progress:
            task = progress.add_task(self.label, total=self.settings.steps, completed=self.step, metrics="")
            while self.step < self.settings.steps:
                self._step(step_loss)
                self._plan_when_timed()
                shown = "  ".join(f"{k} {v:.3f}" for k, v in self.metrics.items())
                progress.update(task, advance=1, total=self.settings.steps, metrics=shown)
                self._checkpoint_when_due(shown)

    def _plan_when_timed(self) -> None:
        """Under a time budget, once TIMED_STEPS steps after the first are timed: fix the
        run's steps to those that fit in what is left of it (at most the planned steps)."""
        now, done = time.perf_counter(), self.step - self.resumed_from
        if self.planned:
            return
        if done == 1:
            self.first_done = now
            return
        if done < TIMED_STEPS + 1 or self.first_done is None:
            return
        fit, per_step = self._steps_that_fit(now)
        _fix_steps(self.settings, max(self.step, min(self.settings.steps, fit)))
        self.planned = True
        self.console.print(f"{self.label}: {self.settings.steps} steps fit in {self.settings.seconds / 60:.1f} min "
                           f"({per_step:.2f} s a step)", markup=False, highlight=False)

    def _steps_that_fit(self, now: float) -> tuple[int, float]:
        """The step the budget's time runs out at, at this run's mean step time since its
        first step (which allocates), and that time."""
        per_step = max(1e-6, (now - self.first_done) / max(1, self.step - self.resumed_from - 1))
        return self.step + int(max(0.0, self.settings.seconds - (now - self.started)) / per_step), per_step

    def _step(self, step_loss: Callable[[int], tuple[torch.Tensor, dict]]) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.step, self.settings) * group["scale"]
        loss, self.metrics = step_loss(self.step)
        if not bool(torch.isfinite(loss.detach())):
            raise self._diverged(f"the loss became {float(loss.detach())}", self.step + 1)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.clip)
        if not bool(torch.isfinite(norm)):
            raise self._diverged(f"the gradient norm became {float(norm)}", self.step + 1)
        self.optimizer.step()
        self.step += 1

    def _checkpoint_when_due(self, shown: str) -> None:
        now = time.perf_counter()
        if now - self.last_checkpoint < self.settings.checkpoint_seconds or self.step >= self.settings.steps:
            return
        self._refit(now)
        self.keep()
        self.last_checkpoint = now
        if not self.console.is_terminal:  # a log gets a line per checkpoint instead of a bar
            left = (now - self.started) / max(1, self.step - self.resumed_from) * (self.settings.steps - self.step)
            self.console.print(f"{self.label}: step {self.step}/{self.settings.steps}  {shown}  ~{left / 60:.1f} min "
                               "left", markup=False, highlight=False)

    def _refit(self, now: float) -> None:
        """Steps slower than the first ones timed (a busier machine, a colder cache): cut the
        count to what still fits the budget this run fixed, never raising it."""
        if not self.planned or self.first_done is None:  # no budget, or fixed by an earlier run
            return
        fit, _ = self._steps_that_fit(now)
        if fit < self.settings.steps:
            _fix_steps(self.settings, max(self.step + 1, fit))

    def keep(self) -> None:
        """Checkpoint and save the drafter, unless its weights are no longer finite."""
        if not _finite(self.params):
            raise self._diverged("the weights became nan or infinite", self.step)
        _checkpoint(self.state_path, self.module, self.optimizer, self.settings, self.step, self.planned)
        self.save(self.step, self.metrics)
        self.kept = self.step

    def interrupted(self, stop: KeyboardInterrupt) -> None:
        """Ctrl-C or SIGTERM: save what was learned (unless the weights are not finite)."""
        how = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
        if not _finite(self.params):
            self.console.print(f"{self.label}: {how} at step {self.step}/{self.settings.steps}; its weights were no "
                               "longer finite numbers, so nothing was saved", markup=False, highlight=False)
            return
        self.keep()
        self.console.print(f"{self.label}: {how} at step {self.step}/{self.settings.steps}; saved what it has learned "
                           f"to {self.out} (run the same command again to continue)", markup=False, highlight=False)

    def _diverged(self, what: str, at: int) -> TrainingDiverged:
        where = (f"{self.out} keeps the checkpoint of step {self.kept}" if self.kept is not None else
                 f"nothing was saved to {self.out}")
        return TrainingDiverged(f"{self.label}: {what} at step {at} of {self.settings.steps}, so training stopped; "
                                f"{where} (a lower --lr may train; --restart starts over)")


def _finite(params: list[torch.nn.Parameter]) -> bool:
    return all(bool(torch.isfinite(p.detach()).all()) for p in params)


def _resume(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: LoopSettings,
            console: Console) -> tuple[int, bool]:
    """The step a saved state of the same identity reached (0 without one), and whether the
    run's step count is fixed: always without a time budget; with one, when the state says
    its run had fixed it (`settings.steps` then becomes that count)."""
    fixed = settings.seconds is None
    if not path.exists():
        return 0, fixed
    try:  # weights_only: a state planted in the output folder is data, never code that runs
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn, foreign or code-carrying file: train from scratch rather than fail
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        console.print(f"ignoring unreadable training state {path} ({first})", markup=False)
        return 0, fixed
    if not isinstance(state, dict) or state.get("identity") != settings.identity:
        console.print(f"{path} is from a run with other data or settings: training from scratch", markup=False)
        return 0, fixed
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = int(state["step"])
    if not fixed and state.get("planned") and isinstance(state.get("steps"), int):
        _fix_steps(settings, max(step, min(settings.steps, state["steps"])))
        fixed = True
    if step < settings.steps:
        console.print(f"resuming from step {step} of {settings.steps} ({path})", markup=False)
    return step, fixed


def _fix_steps(settings: LoopSettings, steps: int) -> None:
    """A time budget's step count; a warmup planned for more steps shrinks with it (as
    `train_run.loop_settings` sets it), so the rate still peaks and decays."""
    settings.steps = steps
    settings.warmup = min(settings.warmup, steps // 10 + 1)


def _checkpoint(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: LoopSettings,
                step: int, planned: bool) -> None:
    with staged_file(path) as partial:
        torch.save({"identity": settings.identity, "step": step, "steps": settings.steps, "planned": planned,
                    "model": module.state_dict(), "optimizer": optimizer.state_dict()}, partial)
