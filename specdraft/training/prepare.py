"""What every `train` command prepares before it trains: the frozen target, the corpus as
token sequences, the target's features over them (computed once, cached on disk) and the
held-out split.

Each step is its own function, in the order the command runs them: the files first (no
model loads for a `--data` that names no text), then the target, the sequences, the
features and the split.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from rich.console import Console

from specdraft.profile import Profile, load_profile
from specdraft.drafters.head_model import TargetSignature
from specdraft.errors import UsageError
from specdraft.storage.cache_root import cache_dir
from specdraft.models.loading import eos_token_ids
from specdraft.training.corpus import documents, walk
from specdraft.training.features import FeatureSet, extract_features, feature_key, finished, sequences_of, token_stream
from specdraft.ui.progress import progress_bar

HELD_OUT = 0.05  # share of sequences kept out of training to report the drafter's KL and top-1


@dataclass(frozen=True)
class CorpusSettings:
    """The options of a `train` command that say what to prepare."""

    pool: str
    data: list[str]
    seq_len: int
    max_tokens: Optional[int]
    chat: Optional[bool]  # None: the chat template when the tokenizer has one
    device: str
    features: Optional[str]  # folder for the features cache; None: under the cache folder
    seed: int


@dataclass
class FrozenTarget:
    """The pool's target, in eval mode with every parameter frozen."""

    profile: Profile
    model: torch.nn.Module
    tokenizer: Any  # the target's transformers tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass
class Corpus:
    """The token sequences, the target's features over them and the held-out split."""

    paths: list[Path]
    chat: bool  # whether prompt/answer pairs were put in the chat template
    tokens: np.ndarray  # [sequences, seq_len] int32
    data: FeatureSet
    key: str  # names the features: target, token stream and layers
    eos: list[int]
    held_rows: np.ndarray
    train_rows: np.ndarray
    started: float  # perf_counter when the target had loaded


@dataclass
class _Sequences:
    documents: int
    tokens: np.ndarray
    answer: list[bool]  # per token of the stream: whether a drafter learns to predict it
    eos: list[int]


def prepare_corpus(settings: CorpusSettings, layers_of: Callable[[torch.nn.Module], list[int]], console: Console,
                   warn: Callable[[str], None]) -> tuple[FrozenTarget, Corpus]:
    """Read the corpus (`warn` reports a skipped file or line), run the frozen target over
    it once (features of `layers_of(model)` cached on disk), and split off the held-out
    sequences. The target is returned apart from the corpus, so a caller that no longer
    needs it can let it go."""
    paths = corpus_files(settings.data)
    target = load_frozen_target(settings)
    chat = settings.chat if settings.chat is not None else bool(getattr(target.tokenizer, "chat_template", None))
    started = time.perf_counter()
    sequences = _sequences(settings, target, paths, chat, warn)
    layers = sorted(set(layers_of(target.model)))
    data, key = _features(settings, target.model, sequences, layers, console, started)
    held_rows, train_rows = _split(data.sequences, settings.seed)
    return target, Corpus(paths, chat, sequences.tokens, data, key, sequences.eos, held_rows, train_rows, started)


def corpus_files(data: list[str]) -> list[Path]:
    """Every text file `--data` names (UsageError when there is none)."""
    paths = list(walk(data))
    if not paths:
        raise UsageError("--data: no text files found in " + ", ".join(data))
    return paths


def load_frozen_target(settings: CorpusSettings) -> FrozenTarget:
    from specdraft.models.loading import load_model, resolve_device  # looked up now: tests refuse loads

    profile = load_profile(settings.pool)
    device = resolve_device(settings.device, None, "--device")
    loaded = load_model(profile.target, str(profile.file), "target")
    model = loaded.model.to(device).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return FrozenTarget(profile, model, loaded.tokenizer)


def _sequences(settings: CorpusSettings, target: FrozenTarget, paths: list[Path], chat: bool,
               warn: Callable[[str], None]) -> _Sequences:
    """The documents' tokens (each exchange in the chat template when `chat`) cut into
    sequences of --seq-len; UsageError when they make fewer than two."""
    docs = list(documents(paths, warn, exchanges=True))
    eos = sorted(eos_token_ids(target.model, target.tokenizer))
    stream, answer = token_stream(docs, target.tokenizer, chat, eos[0] if eos else None)
    tokens = sequences_of(stream, settings.seq_len, settings.max_tokens)
    if tokens.shape[0] < 2:
        used = len(stream) if settings.max_tokens is None else min(len(stream), settings.max_tokens)
        raise UsageError(f"--data: {used} tokens make fewer than 2 sequences of --seq-len {settings.seq_len}; "
                         "give more text or a shorter --seq-len")
    return _Sequences(len(docs), tokens, answer, eos)


def _features(settings: CorpusSettings, model: torch.nn.Module, sequences: _Sequences, layers: list[int],
              console: Console, started: float) -> tuple[FeatureSet, str]:
    """The target's features at `layers` over the sequences, from the cache when it holds
    them (an unfinished cache resumes), and the key they are cached under."""
    tokens = sequences.tokens
    key = feature_key(json.dumps(TargetSignature.of(model).__dict__, sort_keys=True), tokens, layers)
    folder = Path(settings.features) if settings.features else cache_dir() / "features" / key
    console.print(f"{sequences.documents} documents, {tokens.size:,} tokens in {tokens.shape[0]} sequences of "
                  f"{settings.seq_len}", markup=False)
    reusing = finished(folder, tokens, layers)
    console.print(f"features: reusing {folder}" if reusing else
                  f"running the target over them once; features cached in {folder}", markup=False)
    with progress_bar(console, "target features", tokens.shape[0]) as ticker:  # resumes; opens finished ones
        data = extract_features(model, tokens, layers, folder,
                                lambda done, total: ticker.progress.update(ticker.task, completed=done))
    if not reusing:
        console.print(f"features: {time.perf_counter() - started:.0f} s", markup=False)
    data.answer_mask = sequences_of(sequences.answer, settings.seq_len, settings.max_tokens, dtype=bool)
    return data, key


def _split(sequences: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(held-out rows, training rows), each sorted: a HELD_OUT share (at least one row)
    drawn with `seed`."""
    order = np.random.default_rng(seed).permutation(sequences)
    held = max(1, int(round(sequences * HELD_OUT)))
    return np.sort(order[:held]), np.sort(order[held:])
