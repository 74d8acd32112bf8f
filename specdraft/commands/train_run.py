"""The steps both `train` commands take around the training loop (training/loop.py): how
many steps to run, what a resumed run must match, a fresh start on `--restart`, the
held-out metrics before and after training, and the final save.

Imported when a command runs, after its options were checked: it imports torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from rich.console import Console

from specdraft.commands.train_options import TrainingOptions
from specdraft.training.loop import STATE, LoopResult, LoopSettings, train
from specdraft.training.prepare import Corpus, CorpusSettings

Metrics = dict[str, float]


def corpus_settings(opts: TrainingOptions) -> CorpusSettings:
    return CorpusSettings(pool=opts.pool, data=opts.data, seq_len=opts.seq_len, max_tokens=opts.max_tokens,
                          chat=opts.chat, device=opts.device, features=opts.features, seed=opts.seed)


def planned_steps(opts: TrainingOptions, corpus: Corpus, default_epochs: float) -> int:
    """`--steps`, or `--epochs` (default `default_epochs`) passes over the training rows."""
    if opts.steps is not None:
        return opts.steps
    per_epoch = max(1, len(corpus.train_rows) // opts.batch_sequences)
    return max(1, int(round(per_epoch * (opts.epochs or default_epochs))))


def loop_settings(opts: TrainingOptions, corpus: Corpus, steps: int, identity: dict[str, Any],
                  **extra: Any) -> LoopSettings:
    """The loop's settings; a saved training state resumes only under the same identity:
    the features, the learning rate, the planned steps, the batch and the seed, and what the
    command adds (`identity`); under `--minutes` the step count its first run fixed."""
    same = {"features": corpus.key, "lr": opts.lr, "steps": steps, "batch": opts.batch_sequences,
            "seed": opts.seed, **identity}
    seconds = None if opts.minutes is None else opts.minutes * 60.0
    return LoopSettings(steps=steps, lr=opts.lr, warmup=min(20, steps // 10 + 1), identity=same, seconds=seconds,
                        **extra)


@dataclass
class HeldOut:
    """How a command reports its held-out metrics: KL and top-1 agreement, and the top-1
    agreement at a later draft position (`later`, named `later_label`)."""

    later: str
    later_label: str

    def describe(self, metrics: Metrics) -> str:
        return (f"KL {metrics['kl']:.3f}, top-1 agreement {metrics['top1']:.1%} "
                f"({self.later_label} {metrics[self.later]:.1%})")


@dataclass
class TrainingRun:
    """One command's training: what is trained and how, how it is saved at checkpoints
    (`save`) and at the end (`finish(result, before, after, train_seconds)`), and how it
    is reported."""

    out: Path
    module: torch.nn.Module
    loop: LoopSettings
    step_loss: Callable[[int], tuple[torch.Tensor, Metrics]]
    evaluate: Callable[[np.ndarray], Metrics]
    save: Callable[[int, Metrics], None]
    finish: Callable[[LoopResult, Metrics, Metrics, float], None]
    label: str
    held_out: HeldOut
    before_note: str = ""  # after "held-out before training"
    written: str = "written to"  # before the output folder, in the last line


def run_training(run: TrainingRun, corpus: Corpus, restart: bool, console: Console) -> LoopResult:
    """Start over on `restart`, evaluate, train (resuming a saved state of the same
    identity), evaluate again, save, and report."""
    if restart:
        (run.out / STATE).unlink(missing_ok=True)
    run.out.mkdir(parents=True, exist_ok=True)
    before = run.evaluate(corpus.held_rows)
    console.print(f"held-out before training{run.before_note}: {run.held_out.describe(before)}", markup=False)
    trained_at = time.perf_counter()
    result = train(run.module, run.loop, run.step_loss, run.save, run.out, console, label=run.label)
    after = run.evaluate(corpus.held_rows)
    run.finish(result, before, after, round(time.perf_counter() - trained_at, 1))
    console.print(f"held-out after {result.step} steps: {run.held_out.describe(after)} "
                  f"(trained {result.seconds / 60:.1f} min, total {(time.perf_counter() - corpus.started) / 60:.1f} "
                  f"min); {run.written} {run.out}", markup=False)
    return result


def data_names(corpus: Corpus) -> list[str]:
    """The training files a saved drafter lists (the first 20)."""
    return [str(p) for p in corpus.paths][:20]
