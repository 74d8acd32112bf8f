"""Writing files and folders so that a kill at any instruction leaves either the old
version or the new one, never a mix, and never a leftover that nothing removes.

Every writer stages beside its destination under one naming scheme,
`.<name>.partial-<host>-<pid>-<random>`, so a later writer can tell a leftover of a dead
process (same host, pid gone) from the work of a live one, and remove it.

- `staged_file(path)`: yields a temporary path; on success the file is fsynced, given the
  permissions a new file would get (or the replaced file's), renamed over `path`, and the
  folder entry fsynced.
- `staged_folder(folder)`: the same for a folder of files. An existing folder is replaced
  by an atomic exchange (Linux renameat2 RENAME_EXCHANGE), so the name always holds a
  whole folder; where that call is missing the old folder is moved aside first and
  `recover_folder` moves it back if the process died in between.
- `remove_stale_partials(parent, name)`: the leftovers of dead writers of `name`.
- `folder_lock(folder, exclusive)`: an advisory lock beside a folder (`.<name>.lock`) that
  a replacement holds exclusively and a reader of several files holds shared, so no reader
  takes one file from the old version and the next from the new.

This module sits at the bottom of the layers (like errors.py): it imports nothing of
specdraft's.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator, TextIO

STALE_FOREIGN_S = 3600.0  # a partial from another host (shared cache folder) is left alone this long
_RENAME_EXCHANGE = 2


def host() -> str:
    return socket.gethostname().replace("-", "_").replace(".", "_") or "host"


def partial_prefix(name: str) -> str:
    return f".{name}.partial-{host()}-{os.getpid()}-"


def aside_name(name: str) -> str:
    return f".{name}.replaced-{host()}-{os.getpid()}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # read-only suffices for fsync, and works on read-only files
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """Make a rename or unlink inside `folder` durable (no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def new_file_mode(replaced: Path | None = None) -> int:
    """The permissions a file created by `open()` would get (or `replaced`'s, when it exists)."""
    if replaced is not None:
        with contextlib.suppress(OSError):
            return replaced.stat().st_mode & 0o7777
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without setting it where Linux says it (setting it, even
    back at once, races with another thread creating a file)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def staged_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; write it; it replaces `path` only when the
    block finishes without an exception."""
    file = Path(path)
    parent = file.parent if str(file.parent) else Path(".")
    fd, partial = tempfile.mkstemp(dir=parent, prefix=partial_prefix(file.name))
    os.close(fd)
    staging = Path(partial)
    try:
        yield staging
        _fsync_file(staging)
        os.chmod(staging, new_file_mode(file))
        os.replace(staging, file)
        fsync_dir(parent)
    finally:
        with contextlib.suppress(OSError):
            staging.unlink()


def fresh_stream(path: str | Path) -> TextIO:
    """A text file at `path` to stream records into, flushed by the caller as it goes: a new
    file renamed over the old one before the first record, never the old one truncated, so
    that a name hard-linked to the old file (an input, say) keeps its content."""
    file = Path(path)
    parent = file.parent if str(file.parent) else Path(".")
    fd, partial = tempfile.mkstemp(dir=parent, prefix=partial_prefix(file.name))
    try:
        os.chmod(partial, new_file_mode(file))
        os.replace(partial, file)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    return os.fdopen(fd, "w", encoding="utf-8")


def write_bytes(path: str | Path, data: bytes) -> None:
    with staged_file(path) as staging:
        staging.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    with staged_file(path) as staging:
        with open(staging, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)


@contextlib.contextmanager
def staged_folder(folder: str | Path, lock: bool = True) -> Iterator[Path]:
    """Yield an empty staging folder beside `folder`; fill it; it becomes `folder` (replacing
    an existing one whole) only when the block finishes without an exception. `lock=False`
    where the caller already serializes readers and writers (the learned store)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder, exclusive=True, enabled=lock):
        recover_folder(folder)
    remove_stale_partials(folder.parent, folder.name)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=partial_prefix(folder.name)))
    try:
        yield staging
        for file in staging.rglob("*"):
            if file.is_file():
                _fsync_file(file)
        fsync_dir(staging)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp made it 0700
        with folder_lock(folder, exclusive=True, enabled=lock):
            publish_folder(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def folder_lock(folder: Path, exclusive: bool, enabled: bool = True) -> Iterator[None]:
    """Hold `.<name>.lock` beside `folder`; unlocked where locks or the file cannot be had (a
    read-only folder of shipped stores, Windows): each step is still atomic on its own."""
    fd = -1
    if enabled:
        lock = folder.parent / f".{folder.name}.lock"
        for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
            try:
                fd = os.open(lock, flags, 0o666)
                break
            except OSError:
                continue
    try:
        if fd >= 0:
            try:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            except (ImportError, OSError):
                pass
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # closing releases the lock


def publish_folder(staging: Path, folder: Path) -> None:
    """Rename `staging` to `folder`; an existing `folder` is swapped out atomically and deleted."""
    if not folder.exists():
        os.rename(staging, folder)
    elif _exchange(staging, folder):
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old folder
    else:
        aside = folder.parent / aside_name(folder.name)
        try:
            os.rename(folder, aside)
        except FileNotFoundError:  # gone meanwhile (a writer that holds no lock): nothing to swap
            pass
        os.rename(staging, folder)
        fsync_dir(folder.parent)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(folder.parent)


def recover_folder(folder: Path) -> None:
    """After a kill between the two renames of a replacement without exchange, the old
    folder waits under its aside name: put it back when the name is empty, else drop it."""
    for aside in folder.parent.glob(f".{glob.escape(folder.name)}.replaced-*"):
        if _writer_alive(aside):
            continue
        if folder.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.rename(aside, folder)


def remove_stale_partials(parent: Path, name: str) -> None:
    """Delete the staged files and folders of `name` whose writer is gone."""
    for partial in Path(parent).glob(f".{glob.escape(name)}.partial-*"):
        if _writer_alive(partial):
            continue
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                partial.unlink()


def _writer_alive(staged: Path) -> bool:
    """Whether the process that named this partial (or aside) may still be writing it."""
    tail = staged.name.rsplit(".", 1)[-1]  # partial-<host>-<pid>-<random> or replaced-<host>-<pid>
    parts = tail.split("-")
    if len(parts) >= 3 and parts[1] == host() and parts[2].isdigit():
        return pid_alive(int(parts[2]))
    with contextlib.suppress(OSError):
        return time.time() - os.lstat(staged).st_mtime < STALE_FOREIGN_S
    return True


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the call is not available."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    return False


_renameat2_fn: object = None


def _renameat2():
    global _renameat2_fn
    if _renameat2_fn is None:
        _renameat2_fn = False
        if os.environ.get("SPECDRAFT_NO_RENAME_EXCHANGE") != "1":
            name = ctypes.util.find_library("c")
            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL(name, use_errno=True).renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _renameat2_fn = fn
    return _renameat2_fn or None
