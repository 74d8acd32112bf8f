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

from specdraft.atomic_files import staged_file
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
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for name, parameter in module.named_parameters():
        if parameter.requires_grad:
            scale = next((f for prefix, f in settings.lr_scale.items() if name.startswith(prefix)), 1.0)
            groups.setdefault(scale, []).append(parameter)
    params = [p for group in groups.values() for p in group]
    optimizer = torch.optim.AdamW([{"params": group, "scale": scale} for scale, group in groups.items()],
                                  lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state_path = out / STATE
    step = _resume(state_path, module, optimizer, settings, console)
    resumed_from = step
    kept = step if step else None  # the step of the checkpoint in `out` (a resumed run's is there already)
    started = last_checkpoint = time.perf_counter()
    metrics: dict[str, float] = {}

    def diverged(what: str, at: int) -> TrainingDiverged:
        where = (f"{out} keeps the checkpoint of step {kept}" if kept is not None else
                 f"nothing was saved to {out}")
        return TrainingDiverged(f"{label}: {what} at step {at} of {settings.steps}, so training stopped; {where} "
                                "(a lower --lr may train; --restart starts over)")

    def keep(metrics: dict[str, float]) -> None:
        """Checkpoint and save the drafter, unless its weights are no longer finite."""
        nonlocal kept
        if not _finite(params):
            raise diverged("the weights became nan or infinite", step)
        _checkpoint(state_path, module, optimizer, settings, step)
        save(step, metrics)
        kept = step

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), TextColumn("eta"),
                        TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal)
    try:
        with progress:
            task = progress.add_task(label, total=settings.steps, completed=step, metrics="")
            while step < settings.steps:
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(step, settings) * group["scale"]
                loss, metrics = step_loss(step)
                if not bool(torch.isfinite(loss.detach())):
                    raise diverged(f"the loss became {float(loss.detach())}", step + 1)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(params, settings.clip)
                if not bool(torch.isfinite(norm)):
                    raise diverged(f"the gradient norm became {float(norm)}", step + 1)
                optimizer.step()
                step += 1
                shown = "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())
                progress.update(task, advance=1, metrics=shown)
                now = time.perf_counter()
                if now - last_checkpoint >= settings.checkpoint_seconds and step < settings.steps:
                    keep(metrics)
                    last_checkpoint = now
                    if not console.is_terminal:  # a log gets a line per checkpoint instead of a bar
                        left = (now - started) / max(1, step - resumed_from) * (settings.steps - step)
                        console.print(f"{label}: step {step}/{settings.steps}  {shown}  ~{left / 60:.1f} min left",
                                      markup=False, highlight=False)
    except KeyboardInterrupt as stop:
        how = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
        if not _finite(params):
            console.print(f"{label}: {how} at step {step}/{settings.steps}; its weights were no longer finite "
                          f"numbers, so nothing was saved", markup=False, highlight=False)
            raise
        keep(metrics)
        console.print(f"{label}: {how} at step {step}/{settings.steps}; saved what it has learned to {out} "
                      f"(run the same command again to continue)", markup=False, highlight=False)
        raise
    keep(metrics)
    return LoopResult(step, resumed_from, time.perf_counter() - started, metrics)


def _finite(params: list[torch.nn.Parameter]) -> bool:
    return all(bool(torch.isfinite(p.detach()).all()) for p in params)


def _resume(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: LoopSettings,
            console: Console) -> int:
    if not path.exists():
        return 0
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a torn or foreign file: train from scratch rather than fail
        console.print(f"ignoring unreadable training state {path} ({exc})", markup=False)
        return 0
    if state.get("identity") != settings.identity:
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
