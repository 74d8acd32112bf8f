"""Suffix-drafter stores on disk: built once from files (`specdraft datastore build`), or
learned across runs (`learn = true`).

A store is a folder: `text.npy` (int32 tokens, documents separated by -1), `order.npy`
(the backward-sorted positions of suffix_index.py) and `meta.json` (format version, the
tokenizer's fingerprint, depth, sizes). Both arrays load memory-mapped: opening a store of
any size takes milliseconds, and pages are read only where a lookup goes. A store made
with another tokenizer is refused (its token ids would mean other text).

The learned store lives under the cache folder, one per tokenizer. Every finished prompt
appends one small segment file (so a killed run loses at most the prompt in flight); at
start, once the segments outgrow an eighth of the indexed base, they are compacted into a
new base (oldest documents evicted beyond `max_tokens`) under a file lock, published by
rewriting the `CURRENT` pointer atomically, so a reader never sees half a store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from specdraft.drafters.suffix_index import SEPARATOR, SuffixIndex, build_order, concatenate

FORMAT = 1
META = "meta.json"
CURRENT = "CURRENT"
COMPACT_MIN_TOKENS = 65536


class StoreError(Exception):
    """A store that cannot be used; the message names the folder and why."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identifies a vocabulary: the same token ids mean the same text."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:32]


def write_store(folder: Path, text: np.ndarray, depth: int, fingerprint: str, extra: dict | None = None) -> SuffixIndex:
    """Index `text` and write it as a store at `folder` (replacing one there), atomically."""
    index = SuffixIndex.build(text, depth)
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.partial-"))
    try:
        np.save(staging / "text.npy", index.text)
        np.save(staging / "order.npy", index.order)
        meta = {"format": FORMAT, "tokenizer": fingerprint, "depth": depth, "tokens": index.tokens,
                "documents": int(np.count_nonzero(text == SEPARATOR)) - 1, **(extra or {})}
        (staging / META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return index


def open_store(folder: Path, fingerprint: str) -> SuffixIndex:
    """A store, memory-mapped; StoreError when it is missing, damaged or for another tokenizer."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError(f"{folder} is not a datastore (no {META}); build one with `specdraft datastore build`") from None
    except (OSError, ValueError) as exc:
        raise StoreError(f"{folder}/{META} is unreadable: {exc}") from None
    if meta.get("format") != FORMAT:
        raise StoreError(f"{folder} has datastore format {meta.get('format')}, this specdraft reads {FORMAT}; rebuild it")
    if meta.get("tokenizer") != fingerprint:
        raise StoreError(f"{folder} was built with another tokenizer than the target's; rebuild it for this target")
    try:
        text = np.load(folder / "text.npy", mmap_mode="r")
        order = np.load(folder / "order.npy", mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise StoreError(f"{folder} is damaged ({exc}); rebuild it") from None
    if text.dtype != np.int32 or len(order) != meta.get("tokens") or order.ndim != 1:
        raise StoreError(f"{folder} is damaged (its arrays disagree with {META}); rebuild it")
    return SuffixIndex(text, order, int(meta["depth"]))


def documents_of(text: np.ndarray) -> list[np.ndarray]:
    """The documents of a concatenated text, oldest first."""
    cuts = np.flatnonzero(np.asarray(text) == SEPARATOR)
    return [np.asarray(text[a + 1:b]) for a, b in zip(cuts[:-1], cuts[1:]) if b > a + 1]


class LearnedStore:
    """What earlier runs generated with this tokenizer: an indexed base plus recent segments."""

    def __init__(self, root: Path, fingerprint: str, depth: int, max_tokens: int):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.depth = depth
        self.max_tokens = max_tokens
        self.segments = self.root / "segments"

    def open(self) -> tuple[SuffixIndex | None, list[np.ndarray]]:
        """(the indexed base or None, the documents of segments not compacted yet), compacting first
        when the segments have grown large."""
        self.segments.mkdir(parents=True, exist_ok=True)
        base = self._base()
        pending = self._segment_files()
        pending_tokens = sum(max(0, (f.stat().st_size - 128) // 4) for f in pending)
        if pending_tokens >= max(COMPACT_MIN_TOKENS, (base.tokens if base else 0) // 8):
            with self._locked():
                self._compact()
            base, pending = self._base(), self._segment_files()
        return base, [doc for f in pending for doc in _read_segment(f)]

    def append(self, document: Sequence[int]) -> None:
        """Record one finished prompt and output (one small file, written atomically)."""
        if not len(document):
            return
        self.segments.mkdir(parents=True, exist_ok=True)
        name = f"{time.time_ns():020d}-{os.getpid()}.npy"
        fd, tmp = tempfile.mkstemp(dir=self.segments, prefix=".tmp-", suffix=".npy")
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, concatenate([document]))
        os.replace(tmp, self.segments / name)

    def _base(self) -> SuffixIndex | None:
        try:
            name = (self.root / CURRENT).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        try:
            return open_store(self.root / name, self.fingerprint)
        except StoreError:
            return None  # damaged: the next compaction writes a fresh one

    def _segment_files(self) -> list[Path]:
        return sorted(self.segments.glob("[0-9]*.npy"))

    def _compact(self) -> None:
        """Fold every segment into a new base; evict the oldest documents beyond max_tokens."""
        base = self._base()
        files = self._segment_files()
        documents = (documents_of(base.text) if base else []) + [d for f in files for d in _read_segment(f)]
        kept, total = [], 0
        for doc in reversed(documents):  # newest first
            if total + len(doc) > self.max_tokens:
                break
            kept.append(doc)
            total += len(doc)
        name = f"base-{time.time_ns()}"
        write_store(self.root / name, concatenate(kept[::-1]), self.depth, self.fingerprint)
        pointer = self.root / f".{CURRENT}.{os.getpid()}"
        pointer.write_text(name, encoding="utf-8")
        os.replace(pointer, self.root / CURRENT)
        for f in files:
            f.unlink(missing_ok=True)
        for old in self.root.glob("base-*"):  # readers holding maps keep their pages (POSIX)
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            import fcntl
        except ImportError:  # no advisory locks (Windows): compaction may run twice, still atomic
            yield
            return
        with open(self.root / "lock", "a+") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _read_segment(path: Path) -> list[np.ndarray]:
    try:
        return documents_of(np.load(path))
    except (OSError, ValueError):
        return []  # a segment cut short by a crash: skipped, never fatal
