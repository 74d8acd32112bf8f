"""Output files of bench, trace and calibrate-beta: checked before any model loads, then
written so that what was measured survives a crash or Ctrl-C; and bench's table on stdout.

`check_outputs` refuses (exit 2, naming the flag) a path whose folder is missing or not
writable, a folder given as a file, two flags naming one file, and an output that would
overwrite an input. Records are streamed as JSON lines (flushed per record); whole files
(a summary, a CSV, a profile) are written to a temporary sibling and renamed into place,
so a reader never sees half a file. A CSV holds no Python reprs: nested values become their
own columns.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from rich.console import Console

from specdraft.storage.atomic_files import fresh_stream, write_text
from specdraft.errors import UsageError


def check_outputs(outputs: Iterable[tuple[str, str | None]], inputs: Iterable[tuple[str, str | None]] = ()) -> None:
    """`outputs`/`inputs`: (flag, path or None) pairs; raises UsageError for the first problem."""
    seen: dict[tuple, str] = {}
    sources = {_key(Path(p)): flag for flag, p in inputs if p}
    for flag, path in outputs:
        if not path:
            continue
        check_writable(flag, path)
        key = _key(Path(path))
        if key in seen:
            raise UsageError(f"{flag} {path}: the same file as {seen[key]}")
        if key in sources:
            raise UsageError(f"{flag} {path}: would overwrite the {sources[key]} input")
        seen[key] = flag


def check_writable(flag: str, path: str | Path) -> None:
    file = Path(path)
    if file.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    folder = file.parent if str(file.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: folder {folder} does not exist")
    if file.exists() and not os.access(file, os.W_OK):
        raise UsageError(f"{flag} {path}: file is not writable")
    # os.access answers for root as if every folder were writable; a real probe does not.
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{file.name}.", suffix=".probe")
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in {folder}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` whole or not at all (atomic_files.py), keeping an existing file's permissions."""
    write_text(path, text)


class JsonLines:
    """Append one JSON object per line, flushed at once, so an interrupted run keeps every
    record written before it stopped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fh = fresh_stream(self.path)
        self.count = 0

    def write(self, record: Any) -> None:
        self.fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.fh.flush()
        self.count += 1

    def close(self) -> None:
        self.fh.close()

    def __enter__(self) -> "JsonLines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key(path: Path) -> tuple:
    """One file's identity: its device and inode where it exists (a hard link or another
    path to an input is that input), else its resolved path."""
    resolved = path.expanduser().resolve()
    try:
        info = os.stat(resolved)
    except OSError:
        return ("path", str(resolved))
    return ("inode", info.st_dev, info.st_ino)


def stdout_console(wide: bool) -> Console:
    """stdout as a Rich console: a terminal's own width, else 100 columns (what the compact
    table fits; 220 for the wide one), never the 80 Rich assumes for a pipe."""
    import sys

    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 220 if wide else 100, highlight=False)


def write_flat_csv(path: str | Path, rows: list[dict]) -> None:
    """`rows` as CSV, whole or not at all, one flat column per value (`_flat`)."""
    import csv
    import io

    flat = [_flat(row) for row in rows]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(dict.fromkeys(k for row in flat for k in row)))
    writer.writeheader()
    writer.writerows(flat)
    write_text(path, buffer.getvalue())


def _flat(row: dict, prefix: str = "") -> dict:
    """One CSV row: nested objects as `key.sub` columns, lists as one column per position
    (`key.1`, `key.2`, ...), numbers and strings as they are."""
    out: dict = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out.update(_flat({str(i): v for i, v in enumerate(value, start=1)}, f"{name}."))
        else:
            out[name] = "" if value is None else round(value, 6) if isinstance(value, float) else value
    return out
