"""Building specdraft's C kernels and loading them, so that a build can never break a run and
nothing is loaded that specdraft did not build.

- The compiler is $CC split as a shell splits it (`CC="ccache gcc"` works), else cc or gcc.
- Builds live in SPECDRAFT_CACHE_DIR/kernels/ when this user owns that folder and nobody else
  may write to it; otherwise (another owner, group- or world-writable, read-only) in a private
  folder made for this process, with a one-line warning.
- A build compiles into a temporary file, syncs it to disk, records its sha256 beside it and
  renames it into place, under a lock per build: a second process waits for the first and
  uses its build. Leftovers of compiles killed midway are removed.
- Before a build is loaded, it and its record must be regular files of this user that nobody
  else may write, and its sha256 must be the recorded one; otherwise it is built again (a
  planted library's code never runs). One that still fails to load (truncated, not a shared
  object) is built again once.
Every failure is a `KernelBuildError` with a one-line cause; callers fall back to torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from specdraft.storage import atomic_files

log = logging.getLogger("specdraft")


class KernelBuildError(RuntimeError):
    """Why the kernels cannot be built or loaded here (one line)."""


def compiler_command() -> list[str]:
    """The C compiler as a command: $CC split like a shell, else cc or gcc."""
    given = os.environ.get("CC", "").strip()
    if given:
        try:
            words = shlex.split(given)
        except ValueError as exc:
            raise KernelBuildError(f"CC={given!r} cannot be split into a command ({exc})") from None
        if not words or shutil.which(words[0]) is None:
            raise KernelBuildError(f"CC={given!r}: {words[0] if words else 'nothing'} is not an installed program")
        return words
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise KernelBuildError("no C compiler (cc or gcc) is installed to build it")
    return [found]


def compiler_version(command: Sequence[str]) -> str:
    """`command --version`'s output (part of a build's key: another compiler builds its own)."""
    try:
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"the C compiler {' '.join(command)} cannot run ({exc})") from None
    return done.stdout


def load_library(name: str, sources: Sequence[Path], flags: Sequence[str], digest: str) -> ctypes.CDLL:
    """The build `name`-`digest`.so of `sources`, checked and loaded (built first where needed)."""
    folder = build_folder()
    target = folder / f"{name}-{digest}.so"
    for attempt in (1, 2):
        if not trusted(target):
            build(target, sources, flags)
        try:
            return ctypes.CDLL(str(target))
        except OSError as exc:
            if attempt == 2:
                raise KernelBuildError(f"the kernel build {target} cannot be loaded: {exc}") from None
            log.warning("specdraft: the kernel build %s cannot be loaded (%s); building it again", target, exc)
            discard(target)
    raise AssertionError("unreachable")


def build_folder() -> Path:
    """SPECDRAFT_CACHE_DIR/kernels when it is safe to build and load from, else a private folder."""
    from specdraft.storage.cache_root import cache_dir

    folder = cache_dir() / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        problem = unsafe(folder) or _unwritable(folder)
    except OSError as exc:
        problem = exc.strerror or str(exc)
    if problem is None:
        return folder
    return _private_folder(str(folder), problem)


@functools.lru_cache(maxsize=None)
def _private_folder(shared: str, problem: str) -> Path:
    private = Path(tempfile.mkdtemp(prefix="specdraft-kernels-"))  # mode 0700, this user's
    log.warning("specdraft: the kernel folder %s cannot be used (%s); building in %s for this run", shared,
                problem, private)
    return private


def unsafe(path: Path) -> str | None:
    """Why `path` may not hold code this process loads, or None: it must be this user's, not a
    link, and writable by nobody else."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return f"{path} belongs to another user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} may be written by other users"
    return None


def _unwritable(folder: Path) -> str | None:
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def record_of(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def trusted(target: Path) -> bool:
    """Whether `target` is a build of ours: a regular file of this user that nobody else may
    write, in such a folder, whose sha256 is the one recorded when it was built."""
    try:
        for path in (target.parent, target, record_of(target)):
            if unsafe(path) is not None:
                return False
        if not stat.S_ISREG(os.lstat(target).st_mode):
            return False
        return record_of(target).read_text(encoding="ascii").strip() == _sha256(target)
    except (OSError, UnicodeDecodeError):
        return False


def build(target: Path, sources: Sequence[Path], flags: Sequence[str]) -> None:
    """Compile `sources` into `target` with its sha256 record, under a lock (another process
    building the same target is waited for and its build used)."""
    command = compiler_command()
    folder = target.parent
    with _locked(folder / f".{target.name}.lock"):
        if trusted(target):
            return
        atomic_files.remove_stale_partials(folder, target.name)
        _remove_old_partials(folder)
        discard(target)
        try:
            fd, partial = tempfile.mkstemp(dir=folder, prefix=atomic_files.partial_prefix(target.name))
        except OSError as exc:
            raise KernelBuildError(f"the kernel folder {folder} cannot be written ({exc.strerror or exc})") from None
        os.close(fd)
        try:
            _compile(command, sources, flags, Path(partial))
            os.chmod(partial, 0o700)
            atomic_files.write_text(record_of(target), _sha256(Path(partial)) + "\n")
            os.replace(partial, target)
            atomic_files.fsync_dir(folder)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(partial)


def _compile(command: Sequence[str], sources: Sequence[Path], flags: Sequence[str], out: Path) -> None:
    try:
        done = subprocess.run([*command, *flags, *map(str, sources), "-o", str(out), "-lm"], capture_output=True,
                              text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"the C compiler {' '.join(command)} cannot run ({exc})") from None
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        raise KernelBuildError(f"compiling {' and '.join(s.name for s in sources)} failed: {first}")
    with open(out, "rb") as fh:  # on disk before anything points at it
        os.fsync(fh.fileno())


def _remove_old_partials(folder: Path) -> None:
    """specdraft 0.1 compiled into `.partial-*.so` without naming its process: such files an
    hour old belong to no compile still running."""
    import time

    for partial in folder.glob(".partial-*.so"):
        with contextlib.suppress(OSError):
            if time.time() - partial.stat().st_mtime > 3600:
                partial.unlink()


def discard(target: Path) -> None:
    for path in (target, record_of(target)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no advisory locks: two first builds may both compile; the rename keeps one
        yield
        return
    try:
        handle = open(lock_file, "a+")
    except OSError as exc:
        raise KernelBuildError(f"the kernel folder {lock_file.parent} cannot be written ({exc.strerror or exc})") \
            from None
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
