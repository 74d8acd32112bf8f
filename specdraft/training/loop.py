"""The training loop every trained drafter kind shares: AdamW with warmup and cosine decay,
gradient clipping, a progress bar with the loss and the time left, a checkpoint every few
minutes that a later run resumes from, and Ctrl-C (or SIGTERM, raised as `Terminated` by
the command) that saves a usable drafter first. A run whose loss, gradient or weights stop
being finite numbers stops with `TrainingDiverged` and saves nothing more: the folder keeps
the last checkpoint written while the weights were finite.

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
        self.step = _resume(self.state_path, module, self.optimizer, settings, console)
        self.resumed_from = self.step
        self.kept = self.step if self.step else None  # the step of the checkpoint in `out` (a resumed run's is there)
        self.started = self.last_checkpoint = time.perf_counter()
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
                shown = "  ".join(f"{k} {v:.3f}" for k, v in self.metrics.items())
                progress.update(task, advance=1, metrics=shown)
                self._checkpoint_when_due(shown)

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
        self.keep()
        self.last_checkpoint = now
        if not self.console.is_terminal:  # a log gets a line per checkpoint instead of a bar
            left = (now - self.started) / max(1, self.step - self.resumed_from) * (self.settings.steps - self.step)
            self.console.print(f"{self.label}: step {self.step}/{self.settings.steps}  {shown}  ~{left / 60:.1f} min "
                               "left", markup=False, highlight=False)

    def keep(self) -> None:
        """Checkpoint and save the drafter, unless its weights are no longer finite."""
        if not _finite(self.params):
            raise self._diverged("the weights became nan or infinite", self.step)
        _checkpoint(self.state_path, self.module, self.optimizer, self.settings, self.step)
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
            console: Console) -> int:
    if not path.exists():
        return 0
    try:  # weights_only: a state planted in the output folder is data, never code that runs
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn, foreign or code-carrying file: train from scratch rather than fail
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        console.print(f"ignoring unreadable training state {path} ({first})", markup=False)
        return 0
    if not isinstance(state, dict) or state.get("identity") != settings.identity:
        console.print(f"{path} is from a run with other data or settings: training from scratch", markup=False)
        return 0
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = int(state["step"])
    if step < settings.steps:
        console.print(f"resuming from step {step} of {settings.steps} ({path})", markup=False)
    return step


def _checkpoint(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: LoopSettings,
                step: int) -> None:
    with staged_file(path) as partial:
        torch.save({"identity": settings.identity, "step": step, "model": module.state_dict(),
                    "optimizer": optimizer.state_dict()}, partial)
