"""`specdraft train steer`: train SD2 steering for a pretrained drafter of the pool (and the
drafter itself, unless `--freeze-drafter`), or with `--no-steering` the distilled baseline
(same data and steps, plain KL). The corpus and the target's features come from the same
preparation as `train head` (its three steering layers and its final state are cached).

The output folder gets steer.json, steer.safetensors and drafter.safetensors (written at
every checkpoint, so an interrupted run still leaves a usable drafter) and the resume state.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from specdraft.commands.io import EXIT_OK, check_count
from specdraft.commands.train import STEER_FILES, check_folders, check_positive, check_training_options, prepare_corpus
from specdraft.errors import ProfileError, UsageError

CHECKPOINT_SECONDS = 600.0  # a checkpoint holds the drafter and its optimizer state: gigabytes


@dataclass
class TrainSteerOptions:
    pool: str
    drafter: str
    data: list[str]
    out: str
    epochs: Optional[float] = None
    steps: Optional[int] = None
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
    import torch

    from specdraft.config.profile import load_profile
    from specdraft.drafters.steering import default_layers, new_steering, save_steering
    from specdraft.models.loading import LoadedModel, check_tokenizers, load_model, native_bf16
    from specdraft.training.loop import STATE, LoopSettings, train
    from specdraft.training.steer import SteerObjective, SteerTrainingSettings

    profile = load_profile(opts.pool)
    spec, key = _drafter_spec(profile, opts.drafter)
    out = Path(opts.out)
    layers = _layers(opts.layers)
    corpus = prepare_corpus(
        opts, lambda model: [*(layers or default_layers(int(model.config.num_hidden_layers))),
                             int(model.config.num_hidden_layers)], console)
    target = corpus.model
    device = next(target.parameters()).device
    drafter_loaded = load_model(spec, str(profile.file), key)
    check_tokenizers(LoadedModel(target, corpus.tokenizer, "the target"), drafter_loaded, str(profile.file), key)
    # float32 master weights; nn.Module's own cast, since transformers refuses `.float()` on
    # a model it loaded from a GGUF file (it counts as quantized though its weights are not)
    drafter = torch.nn.Module.float(drafter_loaded.model.to(device)).train()
    try:
        steering = new_steering(target, drafter, layers, opts.steer_size, steering=opts.steering).to(device)
    except ValueError as exc:
        raise ProfileError(str(profile.file), key, str(exc)) from None
    # Training needs only the target's head (its distributions from the stored final states):
    # keep a copy and let the rest of the target go (a 1.5B target is 6 GB in float32).
    head_weight = target.get_output_embeddings().weight.detach().clone()
    corpus.model = target = None
    gc.collect()
    trained_layers = _trained_layers(drafter, opts, profile, key)
    for parameter in drafter.parameters():
        parameter.requires_grad_(not opts.freeze_drafter and trained_layers is None)
    for layer in trained_layers or ():
        layer.requires_grad_(True)
    for parameter in steering.parameters():
        parameter.requires_grad_(opts.steering)
    bf16 = opts.bf16 if opts.bf16 is not None else native_bf16(device)
    settings = SteerTrainingSettings(batch_sequences=opts.batch_sequences,
                                     max_draft=opts.max_draft or profile.decode.draft_tokens,
                                     steering=opts.steering, bf16=bf16, seed=opts.seed)
    objective = SteerObjective(drafter, steering, head_weight, corpus.data, settings, corpus.train_rows, device)
    per_epoch = max(1, len(corpus.train_rows) // opts.batch_sequences)
    steps = opts.steps if opts.steps is not None else max(1, int(round(per_epoch * (opts.epochs or 1.0))))
    identity = {"features": corpus.key, "drafter": str(spec.describe()), "lr": opts.lr, "steps": steps,
                "batch": opts.batch_sequences, "max_draft": settings.max_draft, "layers": list(steering.config.layers),
                "steering": opts.steering, "frozen": opts.freeze_drafter, "train_layers": opts.train_layers,
                "seed": opts.seed}
    if opts.restart:
        (out / STATE).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    what = "steered" if opts.steering else "distilled"
    before = objective.evaluate(corpus.held_rows)
    console.print(f"held-out before training ({what}, pretrained drafter): KL {before['kl']:.3f}, top-1 agreement "
                  f"{before['top1']:.1%} (last draft offset: {before['top1@last']:.1%})", markup=False)
    trained_at = time.perf_counter()
    module = torch.nn.ModuleDict({"drafter": drafter, "steering": steering})

    def save(step: int, metrics: dict[str, float], extra: dict | None = None) -> None:
        save_steering(out, steering, None if opts.freeze_drafter else drafter,
                      {"steps": step, "of_steps": steps, "tokens": int(corpus.tokens.size), "lr": opts.lr,
                       "seq_len": opts.seq_len, "chat": corpus.chat, "max_draft": settings.max_draft,
                       "train_layers": opts.train_layers,
                       "data": [str(p) for p in corpus.paths][:20], "train_metrics": metrics, **(extra or {})})

    loop = LoopSettings(steps=steps, lr=opts.lr, warmup=min(20, steps // 10 + 1), identity=identity,
                        checkpoint_seconds=CHECKPOINT_SECONDS,
                        lr_scale={"steering.": opts.steer_lr_factor})
    result = train(module, loop, objective.step, save, out, console, label=f"train steer ({what})")
    after = objective.evaluate(corpus.held_rows)
    save(result.step, result.last, {"held_out_kl": after["kl"], "held_out_top1": after["top1"],
                                    "held_out_top1_last": after["top1@last"], "held_out_before": before,
                                    "train_seconds": round(time.perf_counter() - trained_at, 1)})
    console.print(f"held-out after {result.step} steps: KL {after['kl']:.3f}, top-1 agreement {after['top1']:.1%} "
                  f"(last draft offset: {after['top1@last']:.1%}) (trained {result.seconds / 60:.1f} min, total "
                  f"{(time.perf_counter() - corpus.started) / 60:.1f} min); written to {out}", markup=False)
    return EXIT_OK


def _drafter_spec(profile, name: str):
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


def _trained_layers(drafter, opts: TrainSteerOptions, profile, key: str):
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
