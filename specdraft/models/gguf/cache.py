"""The GGUF conversion cache: a GGUF model converted once and saved as safetensors +
config + tokenizer under SPECDRAFT_CACHE_DIR/gguf/<stem>[-<flavour>]-<key>/, so later loads
take seconds instead of tens of seconds.

- An entry holds the weights dequantized into the dtype the model runs in (a bfloat16 entry
  is half a float32 one's bytes and casts nothing), or, for a model on its file's own
  quantization, only the config and tokenizer (`METADATA`): its weights load
  from the mapped file faster than from a second copy (docs/loading.md). Entries of
  specdraft 0.1 that held the repacked weights are removed on the next load
  (`remove_weight_entries`).
- The key follows the file's content, not its path (gguf/key.py). `<stem>` is only for
  people: a lookup takes any entry ending in the key, whatever file name converted it.
- An older specdraft keyed entries by path, size and mtime: the one for this very file is
  renamed to its content key instead of converting again; the others are left alone
  (another environment may still run that older specdraft), stale folders `rm` can remove.
- An entry is written through atomic_files.staged_folder, so a kill at any point leaves the
  old state or the new one; every load removes what dead writers left (gguf/leftovers.py).
- Each entry carries a manifest, checked on every load (gguf/entry.py); a damaged entry is
  rebuilt with a warning.
- A lock file per key (fcntl.flock) serializes conversions of one model: a second process
  waits for the first's and then uses its result.
- A cache folder that cannot be written is detected before converting; the model is then
  loaded straight from the GGUF, uncached, with a warning first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

from specdraft.storage import atomic_files
from specdraft.storage.cache_root import cache_dir
from specdraft.errors import ProfileError
from specdraft.models.gguf.leftovers import remove_dead_leftovers
from specdraft.models.gguf.entry import MANIFEST, manifest_text, verify_entry
from specdraft.models.gguf.key import entry_key, label, legacy_name

log = logging.getLogger("specdraft")

METADATA = "gguf-metadata-1"  # the flavour of an entry holding a GGUF's config and tokenizer only
# Conversion seconds per MB of GGUF, from the demo file on a 2-core CPU: only for the
# estimate the first load announces.
_SECONDS_PER_MB = 0.35


def entry_folder(gguf: Path, dtype: str = "float32") -> Path:
    """Where `gguf` converted to `dtype` (a torch dtype's name, e.g. "bfloat16", or another
    flavour of entry) is cached: an existing entry for the same content and flavour (under
    whatever file name converted it), else `<stem>[-<dtype>]-<key>`."""
    return _folder_for(entry_key(gguf, dtype), gguf, dtype)


def _folder_for(key: str, gguf: Path, dtype: str) -> Path:
    root = cache_dir() / "gguf"
    named = root / f"{label(gguf, dtype)}-{key}"
    if named.is_dir():
        return named
    with contextlib.suppress(OSError):
        for other in sorted(root.glob(f"*-{key}")):
            if not other.name.startswith(".") and other.is_dir():
                return other
    return named


def legacy_folder(gguf: Path, dtype: str) -> Path | None:
    """Where specdraft before content keys cached `gguf` (gguf_key.legacy_name)."""
    name = legacy_name(gguf, dtype)
    return None if name is None else cache_dir() / "gguf" / name


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
    if verify_entry(folder) is None:
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
        if dtype == METADATA:
            log.info("reading %s's config and tokenizer once, cached at %s", gguf.name, folder)
        else:
            log.info("converting %s to %s once (~%d s), cached at %s", gguf.name, dtype, seconds, folder)
        _convert(gguf, folder, file, key, lambda path: load(path, dtype), write or _write_float)
    return folder


# specdraft 0.1 cached a model on its own quantization as repacked weights (about the file's
# size again); its flavours are removed by the load that no longer needs them.
OLD_WEIGHT_FLAVOURS = ("specdraft-file-quantization-3", "specdraft-file-quantization-2",
                       "specdraft-file-quantization-1")


def remove_weight_entries(gguf: Path) -> None:
    """Remove this file's cache entries of repacked weights written by specdraft 0.1."""
    import shutil

    try:
        folders = [entry_folder(gguf, flavour) for flavour in OLD_WEIGHT_FLAVOURS]
    except OSError:
        return
    for folder in folders:
        if folder.is_dir():
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            with _locked(folder.parent / f"{folder.name.rsplit('-', 1)[-1]}.lock", gguf.name):
                shutil.rmtree(folder, ignore_errors=True)
            log.info("removed %s (%.0f MB): the weights of %s now load from the file itself", folder,
                     size / 1e6, gguf.name)


def estimate_seconds(gguf: Path) -> int:
    return max(5, round(gguf.stat().st_size / 1e6 * _SECONDS_PER_MB))


def _take_over_legacy(gguf: Path, dtype: str, folder: Path) -> bool:
    """Rename this very file's entry of an older specdraft (keyed by path, size and mtime) to
    its content-keyed name, when it is whole: no conversion after an upgrade."""
    legacy = legacy_folder(gguf, dtype)
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


def tie_absent_head(model: Any, gguf: Path, file: str, key: str, loaded: Collection[str] | None = None) -> None:
    """A GGUF without `output.weight` shares the embedding as its head (transformers then
    sets `tie_word_embeddings`). transformers ties them while loading, but not reliably:
    fresh CI runs saved an untied head, on the meta device or randomly initialized (rarely,
    nondeterministically), and a cached conversion, which safetensors stores under the head's
    name alone, came back with the embedding newly initialized after transformers' own
    bookkeeping of the tie was upset (two models built at once in threads). Tie them here,
    always, to the one the checkpoint held (`loaded`: the names a cached entry's file holds;
    None: the embedding, as read from the GGUF), and refuse clearly if any weight is still
    unloaded."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None and embedding is not None \
            and head.weight.shape == embedding.weight.shape:
        names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        if loaded is not None and names.get(id(head.weight)) in loaded \
                and names.get(id(embedding.weight)) not in loaded:
            embedding.weight = head.weight
        else:
            head.weight = embedding.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ProfileError(file, key, f"converting {gguf.name} left {len(missing)} weights unloaded "
                                      f"(first: {missing[0]})")


def checkpoint_names(folder: Path) -> set[str]:
    """The tensor names a cached conversion's weights file holds (its header alone is read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            names.update(weights.keys())
    return names


def _write_float(model: Any, gguf: Path, folder: Path) -> None:
    from safetensors.torch import save_model

    save_model(model, str(folder / "model.safetensors"))  # dedups tied embeddings


def _convert(gguf: Path, folder: Path, file: str, key: str, load: Callable[[Path], tuple[Any, Any]],
             write: Callable[[Any, Path, Path], None]) -> None:
    try:
        model, tokenizer = load(gguf)
    except (OSError, ValueError, KeyError) as exc:
        raise ProfileError(file, key, f"cannot read GGUF file {gguf}: {_first_line(exc)}") from None
    with atomic_files.staged_folder(folder) as staging:
        write(model, gguf, staging)
        model.config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        text = manifest_text(staging, str(gguf.resolve()))
        (staging / MANIFEST).write_text(text, encoding="utf-8")  # fsynced with the folder


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
