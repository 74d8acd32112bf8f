"""`specdraft train head`: read a corpus, run the frozen target over it once (features
cached on disk), and train a draft head that the `head` drafter kind loads. The corpus is
prepared as for every `train` command (training/prepare.py).

The output folder gets the head (head.safetensors + head.json, written at every
checkpoint, so an interrupted run still leaves a usable head) and the resume state.

Every option is checked before a model loads (train_options.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rich.console import Console

from specdraft.commands.io import EXIT_OK, warner
from specdraft.commands.train_options import HEAD_FILES, check_folders, check_training_options
from specdraft.errors import UsageError

if TYPE_CHECKING:
    import torch

    from specdraft.training.head import HeadObjective
    from specdraft.training.loop import LoopResult
    from specdraft.training.prepare import Corpus, FrozenTarget

MAX_UNROLL = 4  # draft steps a head trains on its own predictions (each one more forward per step)
DEFAULT_EPOCHS = 4.0
ACCEPTANCE_DEPTHS = 4  # draft positions the held-out acceptance is reported for


@dataclass
class TrainHeadOptions:
    pool: str
    data: list[str]
    out: str
    epochs: Optional[float] = None
    steps: Optional[int] = None
    minutes: Optional[float] = None  # a training time budget
    lr: float = 1e-3
    draft_vocab: int = 8192
    seq_len: int = 512
    batch_sequences: int = 8
    unroll: int = 1
    fuse_layers: Optional[str] = None  # "2,15": lower target layers the head reads besides the final feature
    bf16: Optional[bool] = None  # autocast the head's products; None: where bf16 is native
    max_tokens: Optional[int] = None
    chat: Optional[bool] = None
    device: str = "auto"
    features: Optional[str] = None
    restart: bool = False
    seed: int = 0


def run_train_head(opts: TrainHeadOptions, console: Console) -> int:
    _check(opts)
    from specdraft.commands.train_run import corpus_settings
    from specdraft.training.prepare import prepare_corpus

    lower = fuse_layers(opts.fuse_layers)
    target, corpus = prepare_corpus(corpus_settings(opts), lambda model: _layers_read(model, lower, opts),
                                    console, warner(console))
    objective = _objective(opts, target, corpus, lower)
    _train(opts, objective, corpus, lower, console)
    return EXIT_OK


def _layers_read(model: torch.nn.Module, lower: tuple[int, ...], opts: TrainHeadOptions) -> list[int]:
    """The target layers the head reads: `--fuse-layers`, then the final feature."""
    final = int(model.config.num_hidden_layers)
    if any(layer >= final for layer in lower):
        raise UsageError(f"--fuse-layers: the target has {final} layers; lower layers lie in 1..{final - 1} "
                         f"(got {opts.fuse_layers})")
    return [*lower, final]


def _objective(opts: TrainHeadOptions, target: FrozenTarget, corpus: Corpus, lower: tuple[int, ...]
               ) -> HeadObjective:
    """A new head over the corpus's most frequent tokens, and what it learns."""
    import torch

    from specdraft.models.loading import native_bf16
    from specdraft.training.head import HeadObjective, HeadTrainingSettings, draft_vocabulary, new_head

    model, device = target.model, target.device
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    vocab_ids = draft_vocabulary(corpus.data.tokens[corpus.train_rows], opts.draft_vocab, vocab_size,
                                 tuple(corpus.eos))
    torch.manual_seed(opts.seed)
    head = new_head(model, vocab_ids, lower).to(device)
    bf16 = opts.bf16 if opts.bf16 is not None else native_bf16(device)
    settings = HeadTrainingSettings(batch_sequences=opts.batch_sequences, unroll=opts.unroll, bf16=bf16,
                                    seed=opts.seed)
    return HeadObjective(head, model, corpus.data, int(model.config.num_hidden_layers), settings, corpus.train_rows,
                         device)


def _train(opts: TrainHeadOptions, objective: HeadObjective, corpus: Corpus, lower: tuple[int, ...],
           console: Console) -> None:
    from specdraft.commands.train_run import (HeldOut, TrainingRun, data_names, loop_settings, planned_steps,
                                              run_training)
    from specdraft.drafters.head_model import save_head

    out, head, bf16 = Path(opts.out), objective.head, objective.settings.bf16
    steps = planned_steps(opts, corpus, DEFAULT_EPOCHS)
    identity = {"vocab": int(head.vocab_ids.numel()), "unroll": opts.unroll, "loss": "answer tokens",
                "fuse_layers": list(lower), "bf16": bf16,
                "later_steps_attend": "as drafted"}  # a checkpoint from before the training-time test is not resumed
    loop = loop_settings(opts, corpus, steps, identity)  # its steps: those that fit a --minutes budget, once timed

    def save(step: int, metrics: dict[str, float]) -> None:
        save_head(out, head, {"steps": step, "of_steps": loop.steps, "tokens": int(corpus.tokens.size),
                              "data": data_names(corpus), "lr": opts.lr, "seq_len": opts.seq_len,
                              "chat": corpus.chat, "bf16": bf16, "train_metrics": metrics})

    def finish(result: LoopResult, before: dict[str, float], after: dict[str, float], seconds: float) -> None:
        accepted = objective.acceptance(corpus.held_rows, ACCEPTANCE_DEPTHS)
        save_head(out, head.eval(), {**head.config.trained, "held_out_kl": after["kl"],
                                     "held_out_top1": after["top1"], "held_out_top1_second": after["top1@2"],
                                     "held_out_acceptance": [round(a, 4) for a in accepted],
                                     "train_seconds": seconds})
        console.print(f"held-out greedy acceptance by draft position: {acceptance_line(accepted)}", markup=False)

    head.train()
    run_training(TrainingRun(out, head, loop, objective.step,
                             objective.evaluate, save, finish, "train head", HeldOut("top1@2", "second draft token"),
                             written="head written to"), corpus, opts.restart, console)


def acceptance_line(accepted: list[float]) -> str:
    """"1 66.0%, 2 45.1%, 3 30.2%, 4 20.3% (1.62 drafts accepted a round of 4)": the share
    of held-out starts whose first d drafts all hold, and their sum, the drafted tokens a
    round drafting that many accepts on average (the round commits one more)."""
    shares = ", ".join(f"{d} {a:.1%}" for d, a in enumerate(accepted, start=1))
    return f"{shares} ({sum(accepted):.2f} drafts accepted a round of {len(accepted)})"


def fuse_layers(text: str | None) -> tuple[int, ...]:
    """`--fuse-layers 2,15` -> (2, 15): distinct positive layer numbers, ascending."""
    if text is None:
        return ()
    try:
        values = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        values = ()
    if not values or values[0] < 1:
        raise UsageError(f"--fuse-layers: comma-separated layer numbers from 1, e.g. 2,15 (got {text!r})")
    return values


def _check(opts: TrainHeadOptions) -> None:
    check_training_options(opts)
    fuse_layers(opts.fuse_layers)
    if opts.draft_vocab < 2:
        raise UsageError(f"--draft-vocab: must be at least 2 (got {opts.draft_vocab})")
    if not 1 <= opts.unroll <= MAX_UNROLL:
        raise UsageError(f"--unroll: 1 to {MAX_UNROLL} (got {opts.unroll})")
    check_folders(opts, HEAD_FILES, "a draft head")
