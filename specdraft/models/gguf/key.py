"""The GGUF conversion cache's key: what a GGUF file's entry is named by.

The key follows the file's content, not its path: one GGUF installed in two environments
(or copied, or renamed) shares one entry. It hashes the file's size, its first 16 MiB (the
header: metadata, tokenizer, tensor table; Qwen2.5's 151k-token vocabulary fits in it), 64
evenly spaced 64 KiB samples of the tensor data and its last 64 KiB, with the transformers
version and the entry's flavour: ~20 MiB read whatever the file's size, so a load never pays
for hashing a whole model. The alternative, a full hash remembered per (path, size, mtime,
inode), is exact but makes every new path pay the full hash, is more state to write safely
(none in a read-only cache) and trusts mtimes as the old path key did. Sampling misses only
an edit that keeps the size and the header and touches none of the samples: another model
or quantization differs in header or size, a fine-tune of the same base in every sample.

An older specdraft keyed entries by path, size and mtime (`legacy_name`): gguf/cache.py
renames the entry of this very file to its content key instead of converting again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from pathlib import Path

KEY_VERSION = "content-1"
HEAD_BYTES = 16 << 20  # the header region hashed whole
SAMPLES = 64  # evenly spaced spans of the tensor data ...
SAMPLE_BYTES = 64 << 10  # ... of this many bytes each; the tail is one more


def entry_key(gguf: Path, dtype: str = "float32") -> str:
    """The entry's key: the file's content fingerprint, the transformers version, `dtype`."""
    import transformers

    fingerprint = f"{KEY_VERSION}|{content_fingerprint(gguf)}|{transformers.__version__}|{dtype}"
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def content_fingerprint(gguf: Path) -> str:
    """sha256 of the file's size and the bytes of `sampled_regions` (see the module's doc);
    computed once per process for a file that has not changed since."""
    stat = os.stat(gguf)
    return _fingerprint(str(Path(gguf).resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=16)
def _fingerprint(gguf: str, size: int, mtime_ns: int, inode: int) -> str:
    digest = hashlib.sha256()
    with open(gguf, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        digest.update(struct.pack("<Q", size))
        for start, length in sampled_regions(size):
            fh.seek(start)
            digest.update(fh.read(length))
    return digest.hexdigest()


def sampled_regions(size: int) -> list[tuple[int, int]]:
    """(start, length) of the spans a file of `size` bytes is fingerprinted by: all of a small
    file; else the header region, SAMPLES evenly spaced spans of the rest and the tail."""
    if size <= HEAD_BYTES + (SAMPLES + 1) * SAMPLE_BYTES:
        return [(0, size)]
    gap = (size - SAMPLE_BYTES - HEAD_BYTES) // SAMPLES  # >= SAMPLE_BYTES: the spans never overlap
    return [(0, HEAD_BYTES)] + [(HEAD_BYTES + i * gap, SAMPLE_BYTES) for i in range(SAMPLES)] + \
        [(size - SAMPLE_BYTES, SAMPLE_BYTES)]


def label(gguf: Path, dtype: str) -> str:
    """The human part of an entry's name: the file's stem, and the flavour unless float32."""
    return gguf.stem if dtype == "float32" else f"{gguf.stem}-{dtype}"


def legacy_name(gguf: Path, dtype: str) -> str | None:
    """The entry name specdraft before content keys gave `gguf` (keyed by its path, size and
    mtime), or None when the file cannot be read."""
    import transformers

    try:
        stat = gguf.stat()
        fingerprint = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    except OSError:
        return None
    if dtype != "float32":
        fingerprint += f"|{dtype}"
    return f"{label(gguf, dtype)}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"
