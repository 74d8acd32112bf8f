"""The GGUF conversion cache: a GGUF model converted once and saved as safetensors +
config + tokenizer under SPECDRAFT_CACHE_DIR/gguf/<stem>[-<flavour>]-<key>/, so later loads
take seconds instead of tens of seconds.

- An entry holds what the model will run on: its block codes (the flavour named by
  file_quantization.FORMAT, written by that module), or the weights dequantized into the
  dtype the model runs in (a bfloat16 entry is half a float32 one's bytes and casts nothing).
- The key follows the file's content, not its path: one GGUF installed in two environments
  (or copied, or renamed) shares one entry. It hashes the file's size, its first 16 MiB
  (the header: metadata, tokenizer, tensor table; 5.9 MB for Qwen2.5's 151k-token
  vocabulary), 64 evenly spaced 64 KiB samples of the tensor data and its last 64 KiB, with
  the transformers version and the flavour: ~20 MiB read whatever the size (20-30 ms for a
  1.1 GB file on a 2-core CPU; hashing it all costs ~1.5 s). The alternative, a full hash
  remembered per (path, size, mtime, inode), is exact but makes every new path pay the
  full hash, is more state to write safely (none in a read-only cache) and trusts mtimes as
  the old path key did. Sampling misses only an edit that keeps the size and the header and
  touches none of the samples: another model or quantization differs in header or size, a
  fine-tune of the same base in every sample. `<stem>` is only for people: a lookup takes
  any entry ending in the key, whatever file name converted it.
- An older specdraft keyed entries by path, size and mtime: the one for this very file is
  renamed to its content key instead of converting again; the others are left alone
  (another environment may still run that older specdraft), stale folders `rm` can remove.
- An entry is written through atomic_files.staged_folder (staged in a
  `.<entry>.partial-<host>-<pid>-*` sibling, fsynced, published by one rename, or an atomic
  exchange over a damaged entry), so a kill at any point leaves the old state or the new
  one. Every load removes what dead writers left in the cache folder (those partials, the
  `.partial-<host>-<pid>-*` folders of older versions, a replaced entry's aside) once their
  process is gone, or, from another host, after an hour.
- Each entry carries a manifest (`specdraft.json`: every file's size, mtime and sha256).
  A load compares sizes and mtimes (microseconds; hashing costs ~0.7 s per 500 MB, too
  much for every load) and re-hashes only a file whose mtime moved; it also checks that
  model.safetensors is as long as its own header says. A damaged entry is rebuilt with a
  warning; an entry from an older specdraft without a manifest gets one if it checks out.
- A lock file per key (fcntl.flock) serializes conversions of one model: a second process
  waits for the first's and then uses its result.
- A cache folder that cannot be written is detected before converting; the model is then
  loaded straight from the GGUF, uncached, with a warning first.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from specdraft import atomic_files
from specdraft.errors import ProfileError

log = logging.getLogger("specdraft")

MANIFEST = "specdraft.json"
MANIFEST_VERSION = 2
STALE_PARTIAL_S = 3600.0
_SECONDS_PER_MB = 0.35  # measured: the 98 MB demo GGUF converts in ~33 s on a 2-core CPU
KEY_VERSION = "content-1"
HEAD_BYTES = 16 << 20  # the header region hashed whole
SAMPLES = 64  # evenly spaced spans of the tensor data ...
SAMPLE_BYTES = 64 << 10  # ... of this many bytes each; the tail is one more


def cache_dir() -> Path:
    configured = os.environ.get("SPECDRAFT_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdraft"


def entry_folder(gguf: Path, dtype: str = "float32") -> Path:
    """Where `gguf` converted to `dtype` (a torch dtype's name, e.g. "bfloat16", or another
    flavour of entry) is cached: an existing entry for the same content and flavour (under
    whatever file name converted it), else `<stem>[-<dtype>]-<key>`."""
    return _folder_for(entry_key(gguf, dtype), gguf, dtype)


def entry_key(gguf: Path, dtype: str = "float32") -> str:
    """The entry's key: the file's content fingerprint, the transformers version, `dtype`."""
    import transformers

    fingerprint = f"{KEY_VERSION}|{content_fingerprint(gguf)}|{transformers.__version__}|{dtype}"
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def content_fingerprint(gguf: Path) -> str:
    """sha256 of the file's size and the bytes of `sampled_regions` (see the module's doc)."""
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


def _folder_for(key: str, gguf: Path, dtype: str) -> Path:
    root = cache_dir() / "gguf"
    named = root / f"{_label(gguf, dtype)}-{key}"
    if named.is_dir():
        return named
    with contextlib.suppress(OSError):
        for other in sorted(root.glob(f"*-{key}")):
            if not other.name.startswith(".") and other.is_dir():
                return other
    return named


def _label(gguf: Path, dtype: str) -> str:
    return gguf.stem if dtype == "float32" else f"{gguf.stem}-{dtype}"


def _legacy_folder(gguf: Path, dtype: str) -> Path | None:
    """Where specdraft before content keys cached `gguf` (keyed by its path, size and mtime)."""
    import transformers

    try:
        stat = gguf.stat()
        fingerprint = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    except OSError:
        return None
    if dtype != "float32":
        fingerprint += f"|{dtype}"
    name = f"{_label(gguf, dtype)}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"
    return cache_dir() / "gguf" / name


def converted_gguf(gguf: Path, file: str, key: str, load: Callable[[Path, str], tuple[Any, Any]],
                   dtype: str = "float32", write: Callable[[Any, Path, Path], None] | None = None) -> Path | None:
    """The cache folder holding `gguf` converted to `dtype` (converting it first when needed),
    or None when the cache cannot be written: the caller then loads the GGUF directly.
    `load(gguf, dtype)` returns (model, tokenizer) read from the GGUF file; `write(model,
    gguf, folder)` saves the weights (default: model.safetensors; `dtype` then names
    another flavour of entry, e.g. the file's own quantization)."""
    try:
        entry = entry_key(gguf, dtype)
    except OSError as exc:
        raise ProfileError(file, key, f"cannot read GGUF file {gguf}: {exc.strerror or exc}") from None
    root = cache_dir() / "gguf"
    remove_dead_leftovers(root)
    folder = _folder_for(entry, gguf, dtype)
    problem = verify_entry(folder)
    if problem is None:
        return folder
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise ProfileError(file, key, f"loading .gguf files needs {needed}: pip install 'specdraft[gguf]'")
    seconds = estimate_seconds(gguf)
    unwritable = _unwritable(root)
    if unwritable:
        log.warning("cache folder %s cannot be written (%s): loading %s without caching, which takes ~%d s "
                    "on every run; set SPECDRAFT_CACHE_DIR to a writable folder", root, unwritable,
                    gguf.name, seconds)
        return None
    with _locked(root / f"{entry}.lock", gguf.name):
        remove_dead_leftovers(root)  # a writer killed while we waited
        folder = _folder_for(entry, gguf, dtype)  # another process may have converted it while we waited
        problem = verify_entry(folder)
        if problem is None:
            return folder
        if problem == "missing" and _take_over_legacy(gguf, dtype, folder):
            return folder
        if problem != "missing":
            log.warning("cached conversion %s is unusable (%s); rebuilding it", folder, problem)
        log.info("converting %s to %s once (~%d s), cached at %s", gguf.name, dtype, seconds, folder)
        _convert(gguf, folder, file, key, lambda path: load(path, dtype), write or _write_float)
    return folder


def estimate_seconds(gguf: Path) -> int:
    return max(5, round(gguf.stat().st_size / 1e6 * _SECONDS_PER_MB))


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


def remove_dead_leftovers(root: Path) -> None:
    """Delete what writers that are gone (same host, dead pid; from another host: older
    than an hour) left in `root`: the partial folders and files of atomic_files, the
    `.partial-<host>-<pid>-*` folders of specdraft before it, and the aside of a replaced
    entry (put back when the entry's name is empty, atomic_files.recover_folder)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    staged, asides = set(), set()
    for name in names:
        if name.startswith(".partial-"):
            _remove_legacy_partial(root / name)
        elif name.startswith(".") and ".partial-" in name:
            staged.add(name[1:].rsplit(".partial-", 1)[0])
        elif name.startswith(".") and ".replaced-" in name:
            asides.add(name[1:].rsplit(".replaced-", 1)[0])
    for name in sorted(asides):
        atomic_files.recover_folder(root / name)
    for name in sorted(staged):
        atomic_files.remove_stale_partials(root, name)


def _remove_legacy_partial(partial: Path) -> None:
    """A `.partial-<host>-<pid>-*` folder of specdraft before atomic_files, once its writer is gone."""
    parts = partial.name.split("-")
    try:
        age = time.time() - partial.stat().st_mtime
    except OSError:
        return
    same_host = len(parts) >= 4 and parts[1] == _host() and parts[2].isdigit()
    stale = not _alive(int(parts[2])) if same_host else age > STALE_PARTIAL_S
    if stale:
        shutil.rmtree(partial, ignore_errors=True)


def _take_over_legacy(gguf: Path, dtype: str, folder: Path) -> bool:
    """Rename this very file's entry of an older specdraft (keyed by path, size and mtime) to
    its content-keyed name, when it is whole: no conversion after an upgrade."""
    legacy = _legacy_folder(gguf, dtype)
    if legacy is None or legacy == folder or not legacy.is_dir():
        return False
    with _locked(legacy.parent / f"{legacy.name}.lock", gguf.name):  # the lock older versions take
        if verify_entry(legacy) is not None:
            return False
        try:
            os.rename(legacy, folder)
        except OSError:
            return False
    atomic_files.fsync_dir(folder.parent)
    log.info("using %s's conversion cached by an older specdraft, now at %s", gguf.name, folder)
    return True


def tie_absent_head(model: Any, gguf: Path, file: str, key: str) -> None:
    """A GGUF without `output.weight` shares the embedding as its head (transformers then
    sets `tie_word_embeddings`). transformers ties them while loading, but not reliably:
    fresh CI runs saved an untied head, on the meta device or randomly initialized (rarely,
    nondeterministically). Tie it here, always, and refuse clearly if any weight is still
    unloaded."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None and embedding is not None \
            and head.weight.shape == embedding.weight.shape:
        head.weight = embedding.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ProfileError(file, key, f"converting {gguf.name} left {len(missing)} weights unloaded "
                                      f"(first: {missing[0]})")


def _write_float(model: Any, gguf: Path, folder: Path) -> None:
    from safetensors.torch import save_model

    save_model(model, str(folder / "model.safetensors"))  # dedups tied embeddings


def _convert(gguf: Path, folder: Path, file: str, key: str, load: Callable[[Path], tuple[Any, Any]],
             write: Callable[[Any, Path, Path], None]) -> None:
    try:
        model, tokenizer = load(gguf)
    except (OSError, ValueError, KeyError) as exc:
        raise ProfileError(file, key, f"cannot read GGUF file {gguf}: {_first_line(exc)}") from None
    tie_absent_head(model, gguf, file, key)
    with atomic_files.staged_folder(folder) as staging:
        write(model, gguf, staging)
        model.config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {}
        for path in sorted(staging.iterdir()):
            stat = path.stat()
            files[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256(path)}
        manifest = {"version": MANIFEST_VERSION, "source": str(gguf.resolve()), "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")  # fsynced with the folder


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
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name != MANIFEST and not path.name.startswith(".") and path.is_file():
            stat = path.stat()
            files[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256(path)}
    with contextlib.suppress(OSError):  # a read-only cache still serves the checked entry
        manifest = {"version": MANIFEST_VERSION, "source": old.get("source"), "files": files}
        atomic_files.write_text(folder / MANIFEST, json.dumps(manifest, indent=1))
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


def _unwritable(root: Path) -> str | None:
    """Why files cannot be created in `root`, or None. A real probe: os.access answers
    yes to root even in a read-only folder."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=atomic_files.partial_prefix("probe"))  # removed if killed
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


@contextlib.contextmanager
def _locked(lock_file: Path, name: str) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; conversions may then run twice
        yield
        return
    with open(lock_file, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another specdraft process that is converting %s", name)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _host() -> str:
    return "".join(ch for ch in socket.gethostname() if ch.isalnum())[:32] or "host"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
