"""`specdraft train head`: read a corpus, run the frozen target over it once (features
cached on disk), and train a draft head that the `head` drafter kind loads. The corpus
preparation (`prepare_corpus`) is shared with `train steer` (train_steer.py).

The output folder gets the head (head.safetensors + head.json, written at every
checkpoint, so an interrupted run still leaves a usable head) and the resume state.

Every option is checked before a model loads: numbers finite and in range, and the folders
written to (`--out`, `--features`) writable and either new, empty or already holding what
specdraft writes there, so that no run overwrites a folder of something else.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from rich.console import Console

from specdraft.commands.io import EXIT_OK, check_count, check_seed, warner
from specdraft.errors import UsageError

HELD_OUT = 0.05  # share of sequences kept out of training to report the head's KL and top-1
MAX_UNROLL = 4  # draft steps a head trains on its own predictions (each one more forward per step)
MAX_EPOCHS = 1e6  # keeps steps = epochs x batches per epoch a finite count for any corpus

# What each command writes into its folders (drafters/head_model.py, drafters/steering.py,
# training/loop.py and training/features.py name them; kept here so the folders are checked
# before torch is imported). A folder is one of ours when it holds the marker file, or
# nothing but these names (a first save cut short).
STATE_FILES = ("training-state.pt", "training-state.tmp")
HEAD_FILES = ("head.json", {"head.json", "head.safetensors", "head.json.tmp", "head.safetensors.tmp", *STATE_FILES})
STEER_FILES = ("steer.json", {"steer.json", "steer.safetensors", "drafter.safetensors", ".steer.json.partial",
                              ".steer.safetensors.partial", ".drafter.safetensors.partial", *STATE_FILES})
FEATURE_FILE = re.compile(r"(meta|done)\.json|features-\d+\.npy")
FEATURE_META_KEYS = ("sequences", "seq_len", "hidden", "layers", "tokens")


@dataclass
class TrainHeadOptions:
    pool: str
    data: list[str]
    out: str
    epochs: Optional[float] = None
    steps: Optional[int] = None
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


@dataclass
class Corpus:
    """What every `train` command prepares: the target, the token sequences, the target's
    features over them (cached) and the held-out split."""

    profile: object
    model: object
    tokenizer: object
    chat: bool
    paths: list
    tokens: np.ndarray
    data: object  # FeatureSet
    key: str
    eos: list[int]
    held_rows: np.ndarray
    train_rows: np.ndarray
    started: float


def prepare_corpus(opts, layers_of, console: Console) -> Corpus:
    """Read the corpus, run the frozen target over it once (features of `layers_of(model)`
    cached on disk), and split off the held-out sequences."""
    from specdraft.training.corpus import walk

    paths = list(walk(opts.data))
    if not paths:
        raise UsageError("--data: no text files found in " + ", ".join(opts.data))

    from specdraft.config.profile import load_profile
    from specdraft.drafters.head_model import TargetSignature
    from specdraft.models.gguf_cache import cache_dir
    from specdraft.models.loading import eos_token_ids, load_model, resolve_device
    from specdraft.training.corpus import documents
    from specdraft.training.features import extract_features, feature_key, finished, sequences_of, token_stream
    from specdraft.ui.progress import progress_bar

    profile = load_profile(opts.pool)
    device = resolve_device(opts.device, None, "--device")
    target = load_model(profile.target, str(profile.file), "target")
    model = target.model.to(device).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    tokenizer = target.tokenizer
    chat = opts.chat if opts.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    started = time.perf_counter()

    docs = list(documents(paths, warner(console), exchanges=True))
    eos = sorted(eos_token_ids(model, tokenizer))
    stream, answer = token_stream(docs, tokenizer, chat, eos[0] if eos else None)
    tokens = sequences_of(stream, opts.seq_len, opts.max_tokens)
    if tokens.shape[0] < 2:
        used = len(stream) if opts.max_tokens is None else min(len(stream), opts.max_tokens)
        raise UsageError(f"--data: {used} tokens make fewer than 2 sequences of --seq-len {opts.seq_len}; "
                         "give more text or a shorter --seq-len")
    layers = sorted(set(layers_of(model)))
    signature = TargetSignature.of(model)
    key = feature_key(json.dumps(signature.__dict__, sort_keys=True), tokens, layers)
    folder = Path(opts.features) if opts.features else cache_dir() / "features" / key
    console.print(f"{len(docs)} documents, {tokens.size:,} tokens in {tokens.shape[0]} sequences of {opts.seq_len}",
                  markup=False)
    reusing = finished(folder, tokens, layers)
    console.print(f"features: reusing {folder}" if reusing else
                  f"running the target over them once; features cached in {folder}", markup=False)
    with progress_bar(console, "target features", tokens.shape[0]) as ticker:  # resumes; opens finished ones
        data = extract_features(model, tokens, layers, folder,
                                lambda done, total: ticker.progress.update(ticker.task, completed=done))
    if not reusing:
        console.print(f"features: {time.perf_counter() - started:.0f} s", markup=False)
    data.answer_mask = sequences_of(answer, opts.seq_len, opts.max_tokens, dtype=bool)

    rng = np.random.default_rng(opts.seed)
    order = rng.permutation(data.sequences)
    held = max(1, int(round(data.sequences * HELD_OUT)))
    return Corpus(profile, model, tokenizer, chat, paths, tokens, data, key, eos, np.sort(order[:held]),
                   np.sort(order[held:]), started)


def run_train_head(opts: TrainHeadOptions, console: Console) -> int:
    _check(opts)
    import torch

    from specdraft.drafters.head_model import save_head
    from specdraft.models.loading import native_bf16
    from specdraft.training.head import HeadObjective, HeadTrainingSettings, draft_vocabulary, new_head
    from specdraft.training.loop import STATE, LoopSettings, train

    out = Path(opts.out)
    lower = fuse_layers(opts.fuse_layers)

    def layers_read(model) -> list[int]:
        final = int(model.config.num_hidden_layers)
        if any(layer >= final for layer in lower):
            raise UsageError(f"--fuse-layers: the target has {final} layers; lower layers lie in 1..{final - 1} "
                             f"(got {opts.fuse_layers})")
        return [*lower, final]

    corpus = prepare_corpus(opts, layers_read, console)
    model, data, tokens, paths, chat = corpus.model, corpus.data, corpus.tokens, corpus.paths, corpus.chat
    device = next(model.parameters()).device
    layer = int(model.config.num_hidden_layers)
    held_rows, train_rows = corpus.held_rows, corpus.train_rows
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    vocab_ids = draft_vocabulary(data.tokens[train_rows], opts.draft_vocab, vocab_size, tuple(corpus.eos))
    torch.manual_seed(opts.seed)
    head = new_head(model, vocab_ids, lower).to(device)
    bf16 = opts.bf16 if opts.bf16 is not None else native_bf16(device)
    settings = HeadTrainingSettings(batch_sequences=opts.batch_sequences, unroll=opts.unroll, bf16=bf16,
                                    seed=opts.seed)
    objective = HeadObjective(head, model, data, layer, settings, train_rows, device)
    per_epoch = max(1, len(train_rows) // opts.batch_sequences)
    steps = opts.steps if opts.steps is not None else max(1, int(round(per_epoch * (opts.epochs or 4.0))))
    identity = {"features": corpus.key, "vocab": int(vocab_ids.numel()), "lr": opts.lr, "steps": steps,
                "batch": opts.batch_sequences, "unroll": opts.unroll, "seed": opts.seed,
                "loss": "answer tokens", "fuse_layers": list(lower), "bf16": bf16}
    if opts.restart:
        (out / STATE).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    before = objective.evaluate(held_rows)
    console.print(f"held-out before training: KL {before['kl']:.3f}, top-1 agreement {before['top1']:.1%} "
                  f"(second draft token {before['top1@2']:.1%})", markup=False)
    trained_at = time.perf_counter()

    def save(step: int, metrics: dict[str, float]) -> None:
        save_head(out, head, {"steps": step, "of_steps": steps, "tokens": int(tokens.size),
                              "data": [str(p) for p in paths][:20], "lr": opts.lr, "seq_len": opts.seq_len,
                              "chat": chat, "bf16": bf16, "train_metrics": metrics})

    head.train()
    result = train(head, LoopSettings(steps=steps, lr=opts.lr, warmup=min(20, steps // 10 + 1), identity=identity),
                   objective.step, save, out, console, label="train head")
    after = objective.evaluate(held_rows)
    save_head(out, head.eval(), {**head.config.trained, "held_out_kl": after["kl"], "held_out_top1": after["top1"],
                                 "held_out_top1_second": after["top1@2"],
                                 "train_seconds": round(time.perf_counter() - trained_at, 1)})
    console.print(f"held-out after {result.step} steps: KL {after['kl']:.3f}, top-1 agreement {after['top1']:.1%} "
                  f"(second draft token {after['top1@2']:.1%}) "
                  f"(trained {result.seconds / 60:.1f} min, total {(time.perf_counter() - corpus.started) / 60:.1f} "
                  f"min); head written to {out}", markup=False)
    return EXIT_OK


def check_training_options(opts) -> None:
    """The options every `train` command shares (steps, epochs, lr, sizes, seed), all before
    a model loads: a nan or infinite number is refused here, not after minutes of loading
    (or, for --lr inf, after training a head of nan weights)."""
    check_count(opts.steps, "--steps")
    check_count(opts.max_tokens, "--max-tokens")
    check_seed(opts.seed)
    if opts.epochs is not None and not 0 < opts.epochs <= MAX_EPOCHS:
        raise UsageError(f"--epochs: must be a number above 0 and at most {MAX_EPOCHS:g} (got {opts.epochs})")
    check_positive(opts.lr, "--lr")
    if opts.seq_len < 8:
        raise UsageError(f"--seq-len: must be at least 8 (got {opts.seq_len})")
    if opts.batch_sequences < 1:
        raise UsageError(f"--batch: must be at least 1 (got {opts.batch_sequences})")
    if opts.max_tokens is not None and opts.max_tokens < 2 * opts.seq_len:
        raise UsageError(f"--max-tokens {opts.max_tokens}: makes fewer than 2 sequences of --seq-len {opts.seq_len} "
                         f"(training needs at least {2 * opts.seq_len} tokens)")


def check_positive(value: float, flag: str) -> None:
    """A float option that must be a finite number above 0."""
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{flag}: must be a finite number above 0 (got {value})")


def check_folders(opts, written: tuple[str, set[str]], what: str) -> None:
    """`--out` and `--features`, before a model loads: each a folder (or to be made) that
    can be written, and new, empty or already holding what specdraft writes there; `written`
    is (the marker file, every name) of what the command writes into --out, `what` names it."""
    out = Path(opts.out)
    check_folder_writable("--out", out)
    marker, names = written
    stranger = _stranger(out, names)
    if stranger is not None and not (out / marker).is_file():
        raise UsageError(f"--out {out}: is not {what}'s folder (it holds {stranger!r}); give a new or empty folder, "
                         f"or one a `train` run wrote {what} to")
    if opts.features is None:
        return
    features = Path(opts.features)
    check_folder_writable("--features", features)
    if _same_folder(features, out):
        raise UsageError(f"--features {features}: the same folder as --out; give each its own")
    meta = features / "meta.json"
    if meta.exists():
        try:
            data = json.loads(meta.read_text(encoding="utf-8"))
            ours = isinstance(data, dict) and all(key in data for key in FEATURE_META_KEYS)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            ours = False
        if not ours:
            raise UsageError(f"--features {features}: its meta.json is not a features cache's; give a new or empty "
                             "folder, or one specdraft cached features in")
        return
    stranger = _stranger(features, None)
    if stranger is not None:
        raise UsageError(f"--features {features}: is not a features cache (it holds {stranger!r}); give a new or "
                         "empty folder, or one specdraft cached features in")


def check_folder_writable(flag: str, folder: Path) -> None:
    """`folder` is a folder, or can be made, and files can be created in it: a real probe
    (os.access answers yes for root everywhere, and for /proc)."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder}: is a file; give a folder")
    probe_in = folder
    while not probe_in.exists() and probe_in != probe_in.parent:  # made with its parents: probe where it starts
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        raise UsageError(f"{flag} {folder}: {probe_in} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=probe_in, prefix=".specdraft-", suffix=".probe")
    except OSError as exc:
        raise UsageError(f"{flag} {folder}: cannot write in {probe_in}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def _stranger(folder: Path, names: set[str] | None) -> str | None:
    """The first entry of `folder` that specdraft does not write there (`names`, or a
    features cache's files when None); None for a missing or empty folder."""
    if not folder.is_dir():
        return None
    for entry in sorted(os.listdir(folder)):
        if not (entry in names if names is not None else FEATURE_FILE.fullmatch(entry)):
            return entry
    return None


def _same_folder(a: Path, b: Path) -> bool:
    return a.expanduser().resolve() == b.expanduser().resolve()


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
