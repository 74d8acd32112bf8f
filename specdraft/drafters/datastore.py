"""The suffix drafter's store format on disk: a folder built once from files (`specdraft
datastore build`) or by the learned store's compactions (drafters/learned_store.py).

A store is a folder: `text.npy` (int32 tokens, documents separated by -1), `order.npy`
(the backward-sorted positions of suffix_index.py) and `meta.json` (format version, the
tokenizer's fingerprint, depth, sizes). Both arrays load memory-mapped: opening a store of
any size takes milliseconds, and pages are read only where a lookup goes. A store made
with another tokenizer is refused (its token ids would mean other text).

Every byte read back is checked before a lookup can trip on it: the metadata's types and
ranges, the arrays' shapes and dtypes, every token id inside the target's vocabulary and
every order entry inside the text (one min/max pass over each array: milliseconds for
millions of tokens). A flipped bit is a StoreError naming the folder, never an IndexError
in the middle of a prompt. A store is written whole or not at all (atomic_files.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.storage.atomic_files import folder_lock, recover_folder, staged_folder
from specdraft.storage.regular_files import is_regular, read_regular_text
from specdraft.drafters.suffix_index import SEPARATOR, SuffixIndex

FORMAT = 1
META = "meta.json"
CURRENT = "CURRENT"
MAX_DEPTH = 256


class StoreError(Exception):
    """A store that cannot be used; the message names the folder and why."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identifies a vocabulary: the same token ids mean the same text."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:32]


def write_store(folder: Path, text: np.ndarray, depth: int, fingerprint: str, extra: dict | None = None,
                lock: bool = True) -> SuffixIndex:
    """Index `text` and write it as a store at `folder` (replacing one there), atomically;
    `lock=False` where the caller serializes readers and writers itself."""
    index = SuffixIndex.build(text, depth)
    with staged_folder(folder, lock=lock) as staging:
        np.save(staging / "text.npy", index.text)
        np.save(staging / "order.npy", index.order)
        meta = {"format": FORMAT, "tokenizer": fingerprint, "depth": depth, "tokens": index.tokens,
                "documents": int(np.count_nonzero(text == SEPARATOR)) - 1, **(extra or {})}
        (staging / META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return index


def read_meta(folder: Path) -> dict:
    """A store's meta.json as a dict; StoreError when missing or not a JSON object."""
    try:
        meta = json.loads(read_regular_text(folder / META, limit=1 << 20))
    except FileNotFoundError:
        raise StoreError(f"{folder} is not a datastore (no {META}); build one with `specdraft datastore build`") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise StoreError(f"{folder}/{META} is unreadable ({exc}); rebuild the store") from None
    if not isinstance(meta, dict):
        raise StoreError(f"{folder}/{META} is damaged (not a JSON object); rebuild the store")
    return meta


def open_store(folder: Path, fingerprint: str, vocab_size: int | None = None, lock: bool = True) -> SuffixIndex:
    """A store, memory-mapped and checked; StoreError when it is missing, damaged, for another
    tokenizer, or holds a token id outside `vocab_size` (the target's logits width). Its
    three files are read under the folder's shared lock: all from one version (a mapped
    file stays readable after a replacement deletes it)."""
    folder = Path(folder)
    with folder_lock(folder, exclusive=False, enabled=lock):
        return _open_store(folder, fingerprint, vocab_size)


def _open_store(folder: Path, fingerprint: str, vocab_size: int | None) -> SuffixIndex:
    if not (folder / META).exists():
        recover_folder(folder)  # a replacement killed between its two renames (no atomic exchange)
    meta = read_meta(folder)
    if meta.get("format") != FORMAT:
        raise StoreError(f"{folder} has datastore format {meta.get('format')!r}, this specdraft reads {FORMAT}; "
                         "rebuild it")
    if meta.get("tokenizer") != fingerprint:
        raise StoreError(f"{folder} was built with another tokenizer than the target's; rebuild it for this target")
    depth, tokens = meta.get("depth"), meta.get("tokens")
    if not _is_int(depth) or not 1 <= depth <= MAX_DEPTH or not _is_int(tokens) or tokens < 0:
        raise StoreError(f"{folder}/{META} is damaged (depth {depth!r}, tokens {tokens!r}); rebuild the store")
    try:
        for name in ("text.npy", "order.npy"):  # a FIFO would block the map's open for ever
            if not is_regular(folder / name):
                raise ValueError(f"{name} is missing or not a regular file")
        text = np.load(folder / "text.npy", mmap_mode="r")
        order = np.load(folder / "order.npy", mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise StoreError(f"{folder} is damaged ({exc}); rebuild it") from None
    problem = _array_problem(text, order, tokens, vocab_size)
    if problem:
        raise StoreError(f"{folder} is damaged ({problem}); rebuild it")
    return SuffixIndex(text, order, depth)


def text_problem(text: np.ndarray, vocab_size: int | None) -> str | None:
    """Why `text` is not a concatenation of documents of valid token ids (None: it is)."""
    if text.dtype != np.int32 or text.ndim != 1:
        return f"text is {text.dtype} of {text.ndim} dimensions, not a 1-D int32 array"
    if len(text) < 1 or text[0] != SEPARATOR or text[-1] != SEPARATOR:
        return "text does not start and end with a separator"
    low, high = int(text.min()), int(text.max())
    if low < SEPARATOR or (vocab_size is not None and high >= vocab_size):
        return f"token ids run from {low} to {high}, outside the vocabulary of {vocab_size}"
    return None


def _array_problem(text: np.ndarray, order: np.ndarray, tokens: int, vocab_size: int | None) -> str | None:
    problem = text_problem(text, vocab_size)
    if problem:
        return problem
    if order.ndim != 1 or not np.issubdtype(order.dtype, np.integer) or len(order) != tokens:
        return f"order is {order.dtype} of shape {order.shape}, {META} says {tokens} tokens"
    if tokens != len(text) - int(np.count_nonzero(text == SEPARATOR)):
        return f"the text holds another number of tokens than {META}'s {tokens}"
    if tokens and (int(order.min()) < 0 or int(order.max()) >= len(text)):
        return "order points outside the text"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def documents_of(text: np.ndarray) -> list[np.ndarray]:
    """The documents of a concatenated text, oldest first."""
    cuts = np.flatnonzero(np.asarray(text) == SEPARATOR)
    return [np.asarray(text[a + 1:b]) for a, b in zip(cuts[:-1], cuts[1:]) if b > a + 1]
