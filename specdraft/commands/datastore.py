"""`specdraft datastore build`: text, JSONL and source files tokenized with the target's
tokenizer into a suffix-drafter store (drafters/datastore.py).

Files and folders are read into documents by `training/corpus.py`.
The output folder is replaced only when it already holds a datastore, never another folder,
and never one the command also reads from (its own meta.json would become the new store).
It is replaced whole or not at all (atomic_files.py): a kill leaves the old store.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from specdraft.commands.io import EXIT_OK, warner
from specdraft.errors import UsageError
from specdraft.training.corpus import documents, walk

BATCH_CHARS = 4_000_000


@dataclass
class DatastoreOptions:
    pool: str
    files: list[str]
    out: str
    depth: int = 32


def run_datastore_build(opts: DatastoreOptions, console: Console) -> int:
    if not 1 <= opts.depth <= 256:
        raise UsageError(f"--depth: must be in 1..256 (got {opts.depth})")
    out = Path(opts.out)
    _check_out(out, opts.files)
    # Never index a store's own files (its meta.json reads as text): not the output's, not
    # another store's met under an input folder.
    paths = [p for p in walk(opts.files) if not (p.parent / "order.npy").exists()]
    if not paths:
        raise UsageError("no text files found in " + ", ".join(opts.files))
    from specdraft.profile import load_profile
    from specdraft.drafters.datastore import tokenizer_fingerprint, write_store
    from specdraft.drafters.suffix_index import concatenate
    from specdraft.models.loading import load_tokenizer

    profile = load_profile(opts.pool)
    tokenizer = load_tokenizer(profile.target, str(profile.file), "target")
    warn = warner(console)
    started = time.perf_counter()
    token_docs: list[list[int]] = []
    batch: list[str] = []
    size = 0
    for document in documents(paths, warn):
        batch.append(document.text)
        size += len(document.text)
        if size >= BATCH_CHARS:
            token_docs += tokenizer(batch, add_special_tokens=False)["input_ids"]
            batch, size = [], 0
    if batch:
        token_docs += tokenizer(batch, add_special_tokens=False)["input_ids"]
    token_docs = [d for d in token_docs if d]
    if not token_docs:
        raise UsageError("the files hold no text to index")
    tokenized = time.perf_counter()
    text = concatenate(token_docs)
    del token_docs
    index = write_store(out, text, opts.depth, tokenizer_fingerprint(tokenizer),
                        {"target": profile.target.describe(), "files": len(paths)})
    indexed = time.perf_counter()
    disk = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    console.print(f"{out}: {index.tokens:,} tokens from {len(paths)} files; tokenized in "
                  f"{tokenized - started:.1f} s, indexed in {indexed - tokenized:.1f} s; {disk:.1f} MiB on disk, "
                  f"peak memory {peak:.0f} MiB", markup=False)
    return EXIT_OK


def _check_out(out: Path, inputs: list[str]) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file; give a folder for the datastore")
    if out.is_dir() and any(out.iterdir()) and not (out / "meta.json").exists():
        raise UsageError(f"--out {out}: folder exists and is not a datastore; refusing to replace it")
    resolved = out.resolve()
    for item in inputs:
        path = Path(item).resolve()
        if path == resolved or resolved in path.parents:
            raise UsageError(f"--out {out}: is also an input ({item}); a store cannot be built from itself")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--out {out}: folder {parent} does not exist")
    # os.access trusts permission bits (root may "write" anywhere, /proc says yes); a real
    # file created and removed there does not lie.
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.", suffix=".probe")
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write in {parent}: {exc.strerror or exc}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
