"""Whether a GGUF conversion cache entry is whole: its manifest, written with it and checked
on every load.

Each entry carries a manifest (`specdraft.json`: every file's size, mtime and sha256). A
load compares sizes and mtimes (hashing every file on every load would cost about as much
as reading the weights) and re-hashes only a file whose mtime moved; it also checks that
each safetensors file is as long as its own header says. An entry from an older specdraft
without a manifest gets one if it checks out.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from pathlib import Path

from specdraft.storage import atomic_files

MANIFEST = "specdraft.json"
MANIFEST_VERSION = 2


def verify_entry(folder: Path) -> str | None:
    """None when the entry is whole; else "missing" or what is wrong with it."""
    manifest_file = folder / MANIFEST
    if not manifest_file.exists():
        return "missing" if not folder.exists() else "no manifest"
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        files = manifest["files"] if manifest.get("version") == MANIFEST_VERSION else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "unreadable manifest"
    if files is None:
        return _adopt(folder, manifest)
    for name, expected in files.items():
        path = folder / name
        try:
            stat = path.stat()
        except OSError:
            return f"{name} is missing"
        if stat.st_size != expected["size"]:
            return f"{name} is {stat.st_size} bytes, expected {expected['size']}"
        if stat.st_mtime_ns != expected["mtime_ns"] and _sha256(path) != expected["sha256"]:
            return f"{name} changed since it was written"
    for name in files:
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(folder / name)
            if problem is not None:
                return problem
    return None


def manifest_text(folder: Path, source: str | None) -> str:
    """The manifest of the files now in `folder` (its dot files and an old manifest left out),
    `source` naming the GGUF file it was converted from."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name != MANIFEST and not path.name.startswith(".") and path.is_file():
            stat = path.stat()
            files[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256(path)}
    return json.dumps({"version": MANIFEST_VERSION, "source": source, "files": files}, indent=1)


def _adopt(folder: Path, old: dict) -> str | None:
    """An entry written before manifests existed: kept (and given a manifest) when its
    weights are as long as their header says and config and tokenizer are there."""
    problem = _safetensors_problem(folder / "model.safetensors")
    if problem is None and not (folder / "config.json").exists():
        problem = "config.json is missing"
    if problem is None and not any(folder.glob("tokenizer*")):
        problem = "the tokenizer is missing"
    if problem is not None:
        return problem
    atomic_files.remove_stale_partials(folder, MANIFEST)  # a manifest write that was killed
    text = manifest_text(folder, old.get("source"))
    with contextlib.suppress(OSError):  # a read-only cache still serves the checked entry
        atomic_files.write_text(folder / MANIFEST, text)
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A truncated safetensors file is shorter than its header's largest data offset."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > size:
                return f"{path.name} has a damaged header"
            header = json.loads(fh.read(length))
        end = max((t["data_offsets"][1] for n, t in header.items() if n != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return f"{path.name} is missing or unreadable"
    if size < 8 + length + end:
        return f"{path.name} is truncated ({size} of {8 + length + end} bytes)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
