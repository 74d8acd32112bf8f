"""How the `specdraft` command starts: the process's memory settings, chosen before anything
heavy is imported, then the command line (cli.py).

On Linux with transparent huge pages in "madvise" mode (a common default) a process's heap
stays on 4 KiB pages unless it asks. A CPU decode step streams the model's weights, hundreds
of small tensors, and walks the KV cache and activations, all allocated through glibc's
malloc; on 4 KiB pages the hardware prefetchers stop at every page boundary and the TLB
misses on nearly every page. glibc (2.35 and later) asks for huge pages for its heap when the
process starts with the tunable `glibc.malloc.hugetlb=1`, which can only be set before the
process starts, so the command runs itself again once with it (docs/usage.md, "Huge pages", has
what it measured). `SPECDRAFT_HUGE_PAGES=0` keeps the process as started; a tunable the user
set is left alone. Only the command line does this: a program importing specdraft decides
its own environment.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

TUNABLE = "glibc.malloc.hugetlb"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
OPT_OUT = "SPECDRAFT_HUGE_PAGES"


def huge_page_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None if unknown."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library's glibc, None for another C library or platform."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def huge_page_environment(environ: Mapping[str, str], platform: str, mode: str | None,
                          glibc: tuple[int, int] | None) -> dict[str, str] | None:
    """The environment to run the command again under, or None to run it as started: only
    where the heap would not get huge pages otherwise ("madvise" mode; "always" gives them
    already, "never" gives none) and glibc reads the tunable."""
    if not platform.startswith("linux") or environ.get(OPT_OUT, "1") == "0":
        return None
    if mode != "madvise" or glibc is None or glibc < (2, 35):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables:  # set already: by the first start, or by the user
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"
    return env


def run_with_huge_pages() -> None:
    """Replace this process with the same command under the huge-page tunable, where it
    would help; return (and run as started) where not, or where the exec fails."""
    env = huge_page_environment(os.environ, sys.platform, huge_page_mode(), glibc_version())
    arguments = getattr(sys, "orig_argv", None)
    if env is None or not arguments:
        return
    try:
        os.execve(sys.executable, [sys.executable, *arguments[1:]], env)
    except OSError:
        return


def main() -> None:
    run_with_huge_pages()
    from specdraft.cli import main as cli_main

    cli_main()
