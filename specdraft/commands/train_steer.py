"""`specdraft train steer`: train SD2 steering for a pretrained drafter of the pool (and the
drafter itself, unless `--freeze-drafter`), or with `--no-steering` the distilled baseline
(same data and steps, plain KL). The corpus and the target's features are prepared as for
`train head` (training/prepare.py; its three steering layers and its final state are cached).

The output folder gets steer.json, steer.safetensors and drafter.safetensors (written at
every checkpoint, so an interrupted run still leaves a usable drafter) and the resume state.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rich.console import Console

from specdraft.commands.io import EXIT_OK, check_count, warner
from specdraft.commands.train_options import STEER_FILES, check_folders, check_positive, check_training_options
from specdraft.errors import ProfileError, UsageError

if TYPE_CHECKING:
    import torch

    from specdraft.config.model_spec import ModelSpec
    from specdraft.profile import Profile
    from specdraft.drafters.steering import Steering
    from specdraft.training.loop import LoopResult
    from specdraft.training.prepare import Corpus, FrozenTarget

CHECKPOINT_SECONDS = 600.0  # a checkpoint holds the drafter and its optimizer state: gigabytes
DEFAULT_EPOCHS = 1.0


@dataclass
class TrainSteerOptions:
    pool: str
    drafter: str
    data: list[str]
    out: str
    epochs: Optional[float] = None
    steps: Optional[int] = None
    minutes: Optional[float] = None  # a training time budget
    lr: float = 5e-5
    steer_lr_factor: float = 10.0  # the steering starts from zero: it learns faster than the drafter
    seq_len: int = 256
    batch_sequences: int = 2
    max_draft: Optional[int] = None  # K of the offsets; default: the profile's draft_tokens
    layers: Optional[str] = None  # "low,mid,high" hidden-state indices of the target
    steer_size: Optional[int] = None
    freeze_drafter: bool = False
    train_layers: Optional[int] = None  # train only the drafter's last N decoder layers
    steering: bool = True
    bf16: Optional[bool] = None
    max_tokens: Optional[int] = None
    chat: Optional[bool] = None
    device: str = "auto"
    features: Optional[str] = None
    restart: bool = False
    seed: int = 0


def run_train_steer(opts: TrainSteerOptions, console: Console) -> int:
    _check(opts)
    from specdraft.commands.train_run import corpus_settings
    from specdraft.profile import load_profile
    from specdraft.drafters.steering import default_layers
    from specdraft.training.prepare import prepare_corpus

    profile = load_profile(opts.pool)
    spec, key = _drafter_spec(profile, opts.drafter)
    layers = _layers(opts.layers)
    target, corpus = prepare_corpus(
        corpus_settings(opts), lambda model: [*(layers or default_layers(int(model.config.num_hidden_layers))),
                                              int(model.config.num_hidden_layers)], console, warner(console))
    models = _models(opts, profile, spec, key, target, layers)
    # Training needs only the target's head (its distributions from the stored final states,
    # kept in `models`): let the rest of the target go (a 1.5B target is 6 GB in float32).
    del target
    gc.collect()
    _set_trainable(models, opts, profile, key)
    _train(opts, profile, spec, models, corpus, console)
    return EXIT_OK


@dataclass
class _Models:
    """What `train steer` trains and reads: the drafter (float32 master weights), the
    steering, and the target's output head."""

    drafter: torch.nn.Module
    steering: Steering
    head_weight: torch.Tensor
    device: torch.device


def _models(opts: TrainSteerOptions, profile: Profile, spec: ModelSpec, key: str, target: FrozenTarget,
            layers: tuple[int, int, int] | None) -> _Models:
    import torch

    from specdraft.drafters.steering import new_steering
    from specdraft.models.loading import LoadedModel, check_tokenizers, load_model

    device = target.device
    # A .gguf drafter would load onto the file's own block codes, which have no gradients:
    # training needs its weights dequantized (float32 master weights, below).
    trainable = dataclasses.replace(spec, quantization="none") if _is_gguf(spec) else spec
    drafter_loaded = load_model(trainable, str(profile.file), key)
    check_tokenizers(LoadedModel(target.model, target.tokenizer, "the target"), drafter_loaded, str(profile.file),
                     key)
    # float32 master weights; nn.Module's own cast, since transformers refuses `.float()` on
    # a model it loaded from a GGUF file (it counts as quantized though its weights are not)
    drafter = torch.nn.Module.float(drafter_loaded.model.to(device)).train()
    try:
        steering = new_steering(target.model, drafter, layers, opts.steer_size, steering=opts.steering).to(device)
    except ValueError as exc:
        raise ProfileError(str(profile.file), key, str(exc)) from None
    return _Models(drafter, steering, target.model.get_output_embeddings().weight.detach().clone(), device)


def _is_gguf(spec: ModelSpec) -> bool:
    return (spec.path or Path(spec.file or "")).name.lower().endswith(".gguf")


def _set_trainable(models: _Models, opts: TrainSteerOptions, profile: Profile, key: str) -> None:
    """All of the drafter, its last --train-layers layers or none of it (--freeze-drafter),
    and the steering unless --no-steering."""
    trained_layers = _trained_layers(models.drafter, opts, profile, key)
    for parameter in models.drafter.parameters():
        parameter.requires_grad_(not opts.freeze_drafter and trained_layers is None)
    for layer in trained_layers or ():
        layer.requires_grad_(True)
    for parameter in models.steering.parameters():
        parameter.requires_grad_(opts.steering)


def _train(opts: TrainSteerOptions, profile: Profile, spec: ModelSpec, models: _Models, corpus: Corpus,
           console: Console) -> None:
    import torch

    from specdraft.commands.train_run import (HeldOut, TrainingRun, data_names, loop_settings, planned_steps,
                                              run_training)
    from specdraft.drafters.steering import save_steering
    from specdraft.models.loading import native_bf16
    from specdraft.training.steer import SteerObjective, SteerTrainingSettings

    out, drafter, steering, device = Path(opts.out), models.drafter, models.steering, models.device
    bf16 = opts.bf16 if opts.bf16 is not None else native_bf16(device)
    settings = SteerTrainingSettings(batch_sequences=opts.batch_sequences,
                                     max_draft=opts.max_draft or profile.decode.draft_tokens,
                                     steering=opts.steering, bf16=bf16, seed=opts.seed)
    objective = SteerObjective(drafter, steering, models.head_weight, corpus.data, settings, corpus.train_rows,
                               device)
    steps = planned_steps(opts, corpus, DEFAULT_EPOCHS)
    identity = {"drafter": str(spec.describe()), "max_draft": settings.max_draft,
                "layers": list(steering.config.layers), "steering": opts.steering, "frozen": opts.freeze_drafter,
                "train_layers": opts.train_layers}

    def save(step: int, metrics: dict[str, float], extra: dict | None = None) -> None:
        save_steering(out, steering, None if opts.freeze_drafter else drafter,
                      {"steps": step, "of_steps": loop.steps, "tokens": int(corpus.tokens.size), "lr": opts.lr,
                       "seq_len": opts.seq_len, "chat": corpus.chat, "max_draft": settings.max_draft,
                       "train_layers": opts.train_layers,
                       "data": data_names(corpus), "train_metrics": metrics, **(extra or {})})

    def finish(result: LoopResult, before: dict[str, float], after: dict[str, float], seconds: float) -> None:
        save(result.step, result.last, {"held_out_kl": after["kl"], "held_out_top1": after["top1"],
                                        "held_out_top1_last": after["top1@last"], "held_out_before": before,
                                        "train_seconds": seconds})

    what = "steered" if opts.steering else "distilled"
    loop = loop_settings(opts, corpus, steps, identity, checkpoint_seconds=CHECKPOINT_SECONDS,
                         lr_scale={"steering.": opts.steer_lr_factor})
    module = torch.nn.ModuleDict({"drafter": drafter, "steering": steering})
    run_training(TrainingRun(out, module, loop, objective.step, objective.evaluate, save, finish,
                             f"train steer ({what})", HeldOut("top1@last", "last draft offset:"),
                             before_note=f" ({what}, pretrained drafter)"), corpus, opts.restart, console)


def _drafter_spec(profile: Profile, name: str) -> tuple[ModelSpec, str]:
    """The pretrained model of drafter `name`: any drafter of the pool with a model source
    of its own (the `model` and `steered` kinds)."""
    for index, drafter in enumerate(profile.drafters):
        if drafter.name == name:
            spec = getattr(drafter.options, "model", None)
            if spec is None:
                raise UsageError(f"--drafter {name}: a {drafter.kind} drafter has no model of its own; steering needs "
                                 "a pretrained model drafter")
            return spec, f"drafters[{index}]"
    names = ", ".join(d.name for d in profile.drafters if getattr(d.options, "model", None)) or "none in this pool"
    raise UsageError(f'--drafter {name}: no such drafter in the pool (model drafters: {names})')


def _trained_layers(drafter: torch.nn.Module, opts: TrainSteerOptions, profile: Profile, key: str):
    """The decoder layers `--train-layers N` trains (the drafter's last N), or None for
    all of the drafter (or none of it, with --freeze-drafter)."""
    if opts.train_layers is None:
        return None
    layers = getattr(getattr(drafter, "model", None), "layers", None)
    if layers is None:
        raise ProfileError(str(profile.file), key, "--train-layers: the drafter has no decoder layer list "
                                                   "(model.layers) to train the last layers of")
    if opts.train_layers > len(layers):
        raise UsageError(f"--train-layers {opts.train_layers}: the drafter has {len(layers)} decoder layers")
    return list(layers)[len(layers) - opts.train_layers:]


def _layers(text: str | None) -> tuple[int, int, int] | None:
    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 0:
        raise UsageError(f"--layers: three hidden-state indices low,mid,high (got {text!r})")
    return values  # type: ignore[return-value]


def _check(opts: TrainSteerOptions) -> None:
    if opts.freeze_drafter and not opts.steering:
        raise UsageError("--freeze-drafter with --no-steering leaves nothing to train")
    if opts.train_layers is not None and opts.freeze_drafter:
        raise UsageError("--train-layers trains part of the drafter, --freeze-drafter none of it: choose one")
    check_training_options(opts)
    check_positive(opts.steer_lr_factor, "--steer-lr-factor")
    check_count(opts.train_layers, "--train-layers")
    check_count(opts.max_draft, "--max-draft")
    check_count(opts.steer_size, "--steer-size")
    _layers(opts.layers)
    check_folders(opts, STEER_FILES, "a trained steering")
