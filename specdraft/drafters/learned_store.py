"""The learned store: what earlier runs generated with one tokenizer, kept under the cache
folder for the suffix drafter's `learn = true`, and safe against kills, races and bad bytes.

Layout of `ROOT` (`SPECDRAFT_CACHE_DIR/suffix/<tokenizer>`):

- `segments/<ns>-<pid>.npy`: one finished prompt each, staged and renamed into place (a
  killed run loses at most the prompt in flight);
- `base-<ns>/`: an indexed store (datastore.py) holding the segments folded into it; its
  meta.json lists their names under `folded`;
- `CURRENT`: the name of the base in use, replaced atomically and fsynced;
- `lock`: an advisory file lock (fcntl.flock). Appends and opens hold it shared,
  compaction holds it exclusively, so no process lists, reads or stats a segment while
  another deletes it.

Compaction (at open, once the segments outgrow an eighth of the base) runs in an order
that survives a kill at any instruction: write the new base whole, publish it in
`CURRENT`, then delete the folded segments and the old bases. A segment still on disk but
listed in the published base's `folded` is already in it: readers skip it and the next
compaction deletes it, so every document is counted exactly once.

Self-repair: a `CURRENT` that is empty, unreadable or names a damaged base is replaced by
the newest intact base (a warning says so); a damaged segment (truncated, another shape or
dtype, a token id outside the vocabulary) is skipped with a warning and deleted at the next
compaction; leftovers of killed processes (staged segments, half-written bases) are
removed at compaction, when no writer can be mid-write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from specdraft.storage.atomic_files import remove_stale_partials, staged_file, write_text
from specdraft.drafters.datastore import StoreError, documents_of, open_store, read_meta, text_problem, \
    write_store
from specdraft.drafters.suffix_index import SuffixIndex, concatenate
from specdraft.storage.regular_files import read_npy

log = logging.getLogger("specdraft")

CURRENT = "CURRENT"
COMPACT_MIN_TOKENS = 65536
_NPY_HEADER = 128
SEGMENT_LIMIT = 1 << 30  # bytes: one prompt and its output, far below this


class LearnedStore:
    """An indexed base plus recent segments; see the module docstring for the protocol."""

    def __init__(self, root: Path, fingerprint: str, depth: int, max_tokens: int, vocab_size: int | None = None):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.depth = depth
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.segments = self.root / "segments"

    def open(self) -> tuple[SuffixIndex | None, list[np.ndarray]]:
        """(the indexed base or None, the documents of segments not compacted yet), compacting first
        when the segments have grown large."""
        self.segments.mkdir(parents=True, exist_ok=True)
        with self._locked(exclusive=False):
            base, folded = self._base()
            pending = self._pending(folded)
            grown = self._compaction_due(base, pending)
        if grown:
            with self._locked(exclusive=True):
                base, folded = self._base()
                if self._compaction_due(base, self._pending(folded)):
                    self._compact(base, folded)
        with self._locked(exclusive=False):
            base, folded = self._base()
            documents = [doc for f in self._pending(folded) for doc in self._read_segment(f)]
        return base, documents

    def append(self, document: Sequence[int]) -> None:
        """Record one finished prompt and output (one small file, written atomically)."""
        if not len(document):
            return
        self.segments.mkdir(parents=True, exist_ok=True)
        with self._locked(exclusive=False):
            name = f"{time.time_ns():020d}-{os.getpid()}.npy"
            with staged_file(self.segments / name) as staging:
                with open(staging, "wb") as fh:
                    np.save(fh, concatenate([document]))

    # --- reading -----------------------------------------------------------------------

    def _base(self) -> tuple[SuffixIndex | None, set[str]]:
        """The published base and the segment names folded into it; a damaged pointer or base
        falls back to the newest intact base."""
        name = self._pointer()
        if name:
            opened = self._open_base(name)
            if opened is not None:
                return opened
        for folder in sorted(self.root.glob("base-*"), reverse=True):
            if folder.name != name:
                opened = self._open_base(folder.name)
                if opened is not None:
                    log.warning("learned store %s: %s names no intact base; using %s", self.root, CURRENT,
                                folder.name)
                    return opened
        if name is not None:
            log.warning("learned store %s: %s names no intact base and none other is; starting a new one",
                        self.root, CURRENT)
        return None, set()

    def _pointer(self) -> str | None:
        try:
            name = (self.root / CURRENT).read_bytes().decode("utf-8").strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError):
            return ""
        return name if name.startswith("base-") and "/" not in name else ""

    def _open_base(self, name: str) -> tuple[SuffixIndex, set[str]] | None:
        folder = self.root / name
        try:
            index = open_store(folder, self.fingerprint, self.vocab_size, lock=False)
            folded = read_meta(folder).get("folded", [])
        except StoreError:
            return None
        if not isinstance(folded, list) or not all(isinstance(f, str) for f in folded):
            return None
        return index, set(folded)

    def _pending(self, folded: set[str]) -> list[Path]:
        return [f for f in sorted(self.segments.glob("[0-9]*.npy")) if f.name not in folded]

    def _compaction_due(self, base: SuffixIndex | None, pending: list[Path]) -> bool:
        tokens = 0
        for f in pending:
            with contextlib.suppress(OSError):
                tokens += max(0, (f.stat().st_size - _NPY_HEADER) // 4)
        return tokens >= max(COMPACT_MIN_TOKENS, (base.tokens if base else 0) // 8)

    def _read_segment(self, path: Path) -> list[np.ndarray]:
        """The documents of one segment; [] (and a warning) when it is damaged."""
        try:  # a regular file whose header agrees with its length: no FIFO waits, no huge allocation
            text = read_npy(path, limit=SEGMENT_LIMIT)
            problem = text_problem(text, self.vocab_size)
        except FileNotFoundError:
            return []
        except (OSError, ValueError, EOFError) as exc:
            problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if problem:
            log.warning("learned store %s: segment %s is damaged (%s); skipped", self.root, path.name, problem)
            return []
        return documents_of(text)

    # --- compaction (under the exclusive lock) ------------------------------------------

    def _compact(self, base: SuffixIndex | None, folded: set[str]) -> None:
        """Fold every pending segment into a new base; evict the oldest documents beyond max_tokens."""
        files = self._pending(folded)
        documents = (documents_of(base.text) if base else []) + [d for f in files for d in self._read_segment(f)]
        kept, total = [], 0
        for doc in reversed(documents):  # newest first
            if total + len(doc) > self.max_tokens:
                break
            kept.append(doc)
            total += len(doc)
        name = f"base-{time.time_ns():020d}"
        write_store(self.root / name, concatenate(kept[::-1]), self.depth, self.fingerprint,
                    {"folded": sorted(f.name for f in files)}, lock=False)
        write_text(self.root / CURRENT, name)
        # Published: from here on a kill leaves only garbage that the next compaction removes.
        for f in self.segments.glob("[0-9]*.npy"):
            if f.name in folded or f in files:
                f.unlink(missing_ok=True)
        for old in self.root.glob("base-*"):  # readers holding maps keep their pages (POSIX)
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        for staged in [*self.segments.glob(".*.partial-*"), *self.segments.glob(".tmp-*")]:
            staged.unlink(missing_ok=True)  # no appender is mid-write under this lock
        for base_name in {p.name.split(".partial-")[0][1:] for p in self.root.glob(".base-*.partial-*")}:
            remove_stale_partials(self.root, base_name)
        remove_stale_partials(self.root, CURRENT)

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        try:
            import fcntl
        except ImportError:  # no advisory locks (Windows): each step is still atomic on its own
            yield
            return
        with open(self.root / "lock", "a+") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
