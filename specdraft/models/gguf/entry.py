"""Whether a GGUF conversion cache entry is whole: its manifest, written with it and checked
on every load, without trusting mtimes.

Each entry carries a manifest (`specdraft.json`): per file its size, mtime, sha256 and, for
a safetensors file, a sampled digest (`sampled_digest`: its header, every tensor of at most
SMALL_TENSOR bytes whole, since a norm or bias flipped is the most damage per byte, and
SAMPLES blocks spread evenly over the rest). A load checks every size; hashes every small
file (config, tokenizer) whole; checks each weights file's sampled digest, and its full
sha256 only when its mtime moved (hashing the weights whole on every load would cost about
as much as reading them). Each safetensors file must also be as long as its header says.
A manifest that is not the expected schema makes the entry damaged (rebuilt), never an
error. An entry with an older manifest whose files all match their sha256 gets the new
manifest; one without any, if its files check out.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from pathlib import Path

from specdraft.storage import atomic_files
from specdraft.storage.regular_files import read_regular_text

MANIFEST = "specdraft.json"
MANIFEST_VERSION = 3
SMALL_FILE = 16 << 20  # bytes: files up to this are hashed whole on every load
SMALL_TENSOR = 64 << 10  # bytes: tensors up to this are in the sampled digest whole
SAMPLES = 256  # blocks of SAMPLE_BYTES spread over the rest of a weights file
SAMPLE_BYTES = 4096


def verify_entry(folder: Path) -> str | None:
    """None when the entry is whole; else "missing" or what is wrong with it."""
    manifest_file = folder / MANIFEST
    if not manifest_file.exists():
        return "missing" if not folder.exists() else "no manifest"
    try:
        manifest = json.loads(read_regular_text(manifest_file, limit=1 << 20))
    except (OSError, ValueError, RecursionError):
        return "unreadable manifest"
    if not isinstance(manifest, dict):
        return "unreadable manifest"
    version = manifest.get("version")
    files = manifest.get("files")
    if version not in (2, MANIFEST_VERSION) or not _well_formed(files, version):
        older = version is None or isinstance(version, int) and not isinstance(version, bool) and version < 2
        return _adopt(folder, manifest) if older else "unreadable manifest"
    for name, expected in files.items():
        path = folder / name
        try:
            stat = path.stat()
        except OSError:
            return f"{name} is missing"
        if stat.st_size != expected["size"]:
            return f"{name} is {stat.st_size} bytes, expected {expected['size']}"
        if version == 2 or stat.st_size <= SMALL_FILE or stat.st_mtime_ns != expected["mtime_ns"]:
            if _sha256(path) != expected["sha256"]:
                return f"{name} changed since it was written"
        elif "sampled" in expected and sampled_digest(path) != expected["sampled"]:
            return f"{name} changed since it was written (a sampled block differs)"
    for name in files:
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(folder / name)
            if problem is not None:
                return problem
    if version == 2:  # every file matched its full hash: it gets the sampled digests
        with contextlib.suppress(OSError):
            atomic_files.write_text(manifest_file, manifest_text(folder, manifest.get("source")))
    return None


def _well_formed(files: object, version: int) -> bool:
    """A manifest's `files`: names of plain files in the folder, each with a whole size,
    mtime and sha256 (and, from version 3, a sampled digest for a safetensors file)."""
    if not isinstance(files, dict) or not files:
        return False
    for name, entry in files.items():
        if not (isinstance(name, str) and name and "/" not in name and not name.startswith(".")
                and isinstance(entry, dict)):
            return False
        if not all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool) and entry[k] >= 0
                   for k in ("size", "mtime_ns")):
            return False
        if not isinstance(entry.get("sha256"), str):
            return False
        if version >= 3 and name.endswith(".safetensors") and not isinstance(entry.get("sampled"), str):
            return False
    return True


def sampled_digest(path: Path) -> str:
    """sha256 of a safetensors file's header, its small tensors whole and SAMPLES blocks
    spread evenly over the file (see the module docstring)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        digest.update(head)
        ranges: list[tuple[int, int]] = []
        if len(head) == 8:
            (length,) = struct.unpack("<Q", head)
            length = min(length, max(0, size - 8))
            header_bytes = fh.read(length)
            digest.update(header_bytes)
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError, RecursionError):
                header = json.loads(header_bytes)
                for name, tensor in sorted(header.items()):
                    if name != "__metadata__":
                        begin, end = tensor["data_offsets"]
                        if 0 <= end - begin <= SMALL_TENSOR:
                            ranges.append((8 + length + begin, end - begin))
        stride = max(SAMPLE_BYTES, size // SAMPLES)
        ranges += [(offset, SAMPLE_BYTES) for offset in range(0, size, stride)]
        for offset, count in ranges:
            fh.seek(offset)
            digest.update(fh.read(count))
    return digest.hexdigest()


def manifest_text(folder: Path, source: str | None) -> str:
    """The manifest of the files now in `folder` (its dot files and an old manifest left out),
    `source` naming the GGUF file it was converted from."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name != MANIFEST and not path.name.startswith(".") and path.is_file():
            stat = path.stat()
            files[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256(path)}
            if path.name.endswith(".safetensors"):
                files[path.name]["sampled"] = sampled_digest(path)
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
