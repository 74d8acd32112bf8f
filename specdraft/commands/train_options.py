"""The checks every `train` command runs on its options before a model loads (and before
torch is imported): numbers finite and in range, and the folders written to (`--out`,
`--features`) writable and either new, empty or already holding what specdraft writes
there, so that no run overwrites a folder of something else.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Optional, Protocol

from specdraft.commands.io import check_count, check_seed
from specdraft.errors import UsageError

MAX_EPOCHS = 1e6  # keeps steps = epochs x batches per epoch a finite count for any corpus
MAX_MINUTES = 1e6  # a budget in seconds stays a finite float

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


class TrainingOptions(Protocol):
    """The options every `train` command has (TrainHeadOptions, TrainSteerOptions)."""

    pool: str
    data: list[str]
    out: str
    epochs: Optional[float]
    steps: Optional[int]
    minutes: Optional[float]
    lr: float
    seq_len: int
    batch_sequences: int
    max_tokens: Optional[int]
    chat: Optional[bool]
    device: str
    features: Optional[str]
    restart: bool
    seed: int


def check_training_options(opts: TrainingOptions) -> None:
    """The options every `train` command shares (steps, epochs, lr, sizes, seed), all before
    a model loads: a nan or infinite number is refused here, not after minutes of loading
    (or, for --lr inf, after training a head of nan weights)."""
    check_count(opts.steps, "--steps")
    check_count(opts.max_tokens, "--max-tokens")
    check_seed(opts.seed)
    if opts.epochs is not None and not 0 < opts.epochs <= MAX_EPOCHS:
        raise UsageError(f"--epochs: must be a number above 0 and at most {MAX_EPOCHS:g} (got {opts.epochs})")
    check_positive(opts.lr, "--lr")
    if opts.minutes is not None and not 0 < opts.minutes <= MAX_MINUTES:
        raise UsageError(f"--minutes: must be a number above 0 and at most {MAX_MINUTES:g} (got {opts.minutes})")
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


def check_folders(opts: TrainingOptions, written: tuple[str, set[str]], what: str) -> None:
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
    if opts.features is not None:
        _check_features_folder(Path(opts.features), out)


def _check_features_folder(features: Path, out: Path) -> None:
    """`--features`: writable, not --out, and new, empty or a features cache."""
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
