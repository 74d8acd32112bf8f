"""What killed writers left in a cache folder, removed once they are gone.

Entries are written through atomic_files.staged_folder (staged in a
`.<entry>.partial-<host>-<pid>-*` sibling, published by one rename, or an atomic exchange
over a damaged entry), so a kill leaves a partial folder or a replaced entry's aside beside
the entries; specdraft before atomic_files left `.partial-<host>-<pid>-*` folders. Each is
removed once its process is gone (same host, dead pid) or, from another host, after an hour.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

from specdraft.storage import atomic_files

STALE_PARTIAL_S = 3600.0


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


def legacy_host() -> str:
    """This host's name as specdraft before atomic_files wrote it into its partial folders."""
    return "".join(ch for ch in socket.gethostname() if ch.isalnum())[:32] or "host"


def _remove_legacy_partial(partial: Path) -> None:
    """A `.partial-<host>-<pid>-*` folder of specdraft before atomic_files, once its writer is gone."""
    parts = partial.name.split("-")
    try:
        age = time.time() - partial.stat().st_mtime
    except OSError:
        return
    same_host = len(parts) >= 4 and parts[1] == legacy_host() and parts[2].isdigit()
    stale = not atomic_files.pid_alive(int(parts[2])) if same_host else age > STALE_PARTIAL_S
    if stale:
        shutil.rmtree(partial, ignore_errors=True)

